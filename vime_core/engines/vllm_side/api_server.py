"""vLLM's OpenAI API server (`python -m vime_core.engines.vllm_side.api_server ARGS`, ARGS as vLLM's)
for a one-rank CPU engine, with its engine-core process forked instead of spawned; and, with
VIME_VLLM_INSPECT_IN_PROCESS=1 in its environment, for any engine, with the model class inspected
in this process (`inspect_models_in_process`).

vLLM's CPU platform always asks for spawn (`CpuPlatform.check_and_update_config`), so the engine core
starts a fresh interpreter that imports vLLM and torch again: seconds of every engine start. A
one-rank engine runs its model worker inside the engine core (the "uni" executor,
`vllm_cpu_single_process`), so no other process is started, and the engine core is forked (as the
library forks it; vLLM's server entry point asks for spawn on every platform when
VLLM_WORKER_MULTIPROC_METHOD is unset): before the API server has run a model or a thread pool of
torch's; the child then binds its own threads to the engine's cores. Engines of several ranks keep
vLLM's spawn."""

from __future__ import annotations

import os
import runpy
import sys

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# set to 1 in the server's environment (vllm_env) to keep vLLM's spawn: bench/bench_startup.py compares the two
SPAWN_ENV = "VIME_VLLM_SPAWN_ENGINE_CORE"
# set to 1 (vllm_env) to inspect the model class in the API server's process: opt-in until measured on a GPU
INSPECT_ENV = "VIME_VLLM_INSPECT_IN_PROCESS"


def inspect_models_in_process() -> None:
    """vLLM inspects a model class in a subprocess when its `modelinfos` cache (under
    VLLM_CACHE_ROOT) misses: a fresh interpreter that imports vLLM and torch again, 31 s of a fresh
    H200's 160-s start (docs/measurements.md). This process has imported both already: the
    inspection runs here and vLLM writes its cache as after a subprocess. vLLM runs it there so
    that a model module that initialises CUDA on import does not do so in the API server; if one
    did, vLLM would start its engine core by spawn instead of fork (its own check), slower but
    correct. An inspection that fails here runs in vLLM's subprocess after all."""
    from vllm.model_executor.models import registry  # boundary: vLLM's environment only

    in_subprocess = registry._run_in_subprocess

    def in_this_process(fn):
        try:
            return fn()
        except Exception:
            return in_subprocess(fn)

    registry._run_in_subprocess = in_this_process


def on_cpu() -> bool:
    from vllm.platforms import current_platform  # boundary: vLLM's environment only

    return current_platform.is_cpu()


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
    if os.environ.get(INSPECT_ENV) == "1":
        inspect_models_in_process()
    if os.environ.get(SPAWN_ENV) != "1" and on_cpu():
        fork_one_rank_engine_core()
    sys.argv = [SERVER_MODULE, *sys.argv[1:]]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
