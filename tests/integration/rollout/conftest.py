"""Two real vLLM CPU servers on the tiny Qwen3 model, started once for the whole folder
(package scope: they stop when the folder's tests end), and helpers to build configurations.

Engine shape: fp32 (matches the transformers reference), context 256 so one request can run
long enough to straddle a weight swap; each engine bound to its own core.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

HOOKS = Path(__file__).with_name("hooks.py")
ENGINE_CONTEXT = 256
ENGINE_ENV = "VIME_TEST_ENGINE_ENV=from-vllm-env"  # a variable vLLM ignores, set through vllm_env


def make_cfg(model_dir: Path, vllm_python: str, prompt_data: str = "", **overrides):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values

    values = {
        "hf_checkpoint": str(model_dir),
        "vllm_python": vllm_python,
        "prompt_data": prompt_data,
        "device": "cpu",
        "bf16": False,
        "actor_num_gpus_per_node": 2,  # -> 2 engines
        "rollout_max_prompt_len": 32,
        "rollout_max_response_len": 8,
        "rollout_max_context_len": ENGINE_CONTEXT,
        "rollout_batch_size": 4,
        "n_samples_per_prompt": 4,
        "vllm_server_concurrency": 16,
        "rm_type": "arith",
        "engine_startup_timeout_s": 300,
        "router_policy": "round_robin",
        "seed": 7,
    }
    values.update(overrides)
    return make_config(demo_values(values))


def hook(name: str) -> str:
    return f"{HOOKS}:{name}"


@pytest.fixture(scope="package")
def arith_data(tmp_path_factory) -> str:
    from vime_core.demo.task import write_dataset

    return str(write_dataset(tmp_path_factory.mktemp("arith") / "train.jsonl"))


@pytest.fixture(scope="package")
def engines(tiny_model_dir, vllm_python, cache_dir):
    """Two started EngineServers (started side by side), shut down after the folder's tests. They
    share one engine token (`auth_token`), as a run's engines do: the router forwards a client's
    token to either."""
    from vime_core.engines.auth import EngineToken
    from vime_core.engines.server import EngineServer

    # vLLM's statistics on: the router's test counts each engine's requests in its Prometheus /metrics;
    # ENGINE_ENV: test_engine.py finds it in every process of each server
    cfg = make_cfg(tiny_model_dir, vllm_python, vllm_log_stats=True, vllm_env=[ENGINE_ENV])
    token = EngineToken.new()
    servers = [
        EngineServer(cfg, i, engines_per_node=2, log_dir=str(cache_dir / "engine-logs"), token=token) for i in range(2)
    ]
    errors: list[BaseException] = []

    def start(server):
        try:
            server.start()
        except BaseException as exc:  # surfaced below, after both threads end
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise errors[0]
        yield servers
    finally:
        for s in servers:
            s.shutdown()


@pytest.fixture
def healthy_engines(engines):
    """The engines, each restarted first if an earlier test killed it."""
    for server in engines:
        if not server.is_alive():
            server.restart()
    return engines
