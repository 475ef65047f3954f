"""vLLM's OpenAI API server for a one-rank CPU engine (`python -m vime_core.engines.vllm_side.api_server
ARGS`, ARGS as vLLM's), with its engine-core process forked instead of spawned.

vLLM's CPU platform always asks for spawn (`CpuPlatform.check_and_update_config`), so the engine core
starts a fresh interpreter that imports vLLM and torch again: seconds of every engine start. A
one-rank engine runs its model worker inside the engine core (the "uni" executor,
`vllm_cpu_single_process`), so no other process is started, and the engine core is forked as vLLM
forks it on CUDA hosts: before the API server has run a model or a thread pool of torch's; the
child then binds its own threads to the engine's cores. Engines of several ranks keep vLLM's spawn."""

from __future__ import annotations

import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# set to 1 in the server's environment (vllm_env) to keep vLLM's spawn: bench/bench_startup.py compares the two
SPAWN_ENV = "VIME_VLLM_SPAWN_ENGINE_CORE"


def fork_one_rank_engine_core() -> None:
    """Let vLLM's CPU platform choose its start method, then fork for an engine of one rank."""
    from vllm.platforms import cpu  # boundary: vLLM's environment only (the trainer's has no vLLM)

    choose = cpu.CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        choose(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    cpu.CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def main() -> None:
    if os.environ.get(SPAWN_ENV) != "1":
        fork_one_rank_engine_core()
    sys.argv = [SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
