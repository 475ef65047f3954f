"""`vllm_cache_uri` with real vLLM CPU servers (vime_core/engines/vllm_cache.py): the first engine,
on a cold cache root, stores what its start made (vLLM's model inspection); a second engine with
another cold root gets it back before vLLM starts, and vLLM uses it (its file is not written again)."""

from __future__ import annotations

import time

import pytest

from .conftest import make_cfg

pytestmark = pytest.mark.timeout(400)


def _start(cfg, cache_dir, index: int):
    from vime_core.engines.server import EngineServer

    server = EngineServer(cfg, index, engines_per_node=1, log_dir=str(cache_dir / "engine-logs"), warmup=False)
    server.start()
    return server


def _moves(server, kind: str, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the store runs in a thread once the engine serves
        for moved in list(server.cache_moves):
            if kind in moved:
                return moved[kind]
        time.sleep(0.2)
    raise AssertionError(f"no {kind} in {server.cache_moves}")


def test_a_second_engine_starts_with_what_the_first_stored(tiny_model_dir, vllm_python, cache_dir, tmp_path):
    store = str(tmp_path / "store")
    roots = [tmp_path / "host1-cache", tmp_path / "host2-cache"]
    cfgs = [
        make_cfg(tiny_model_dir, vllm_python, vllm_cache_uri=store, vllm_env=[f"VLLM_CACHE_ROOT={root}"])
        for root in roots
    ]

    first = _start(cfgs[0], cache_dir, 0)
    try:
        assert _moves(first, "restore").get("missing") is True
        stored = _moves(first, "store")
    finally:
        first.shutdown()
    infos = sorted(p.relative_to(roots[0]) for p in (roots[0] / "modelinfos").glob("*.json"))
    assert infos and stored["stored_files"] >= len(infos) and "error" not in stored

    second = _start(cfgs[1], cache_dir, 1)
    try:
        restored = _moves(second, "restore")
        assert restored["restored_files"] == stored["stored_files"] and "error" not in restored
        # vLLM found the model's inspection in its cache: it did not inspect again and rewrite it
        for name in infos:
            assert (roots[1] / name).read_bytes() == (roots[0] / name).read_bytes()
            assert (roots[1] / name).stat().st_mtime == pytest.approx((roots[0] / name).stat().st_mtime, abs=1.0)
        assert second.is_alive()
    finally:
        second.shutdown()
