"""Benchmarks build configurations of their own; a change of the defaults must not break them
silently (bench_publish did once: its 256-token context no longer fit the default prompt length)."""

from __future__ import annotations

from tests.bench_scripts import load_bench


def _load(name: str):
    return load_bench(f"{name}.py", name)


def test_bench_publish_engine_settings_validate(tmp_path):
    from vime_core.config import make_config

    cfg = make_config(_load("bench_publish").engine_settings(tmp_path, bf16=False))  # bf16 needs a GPU
    assert cfg.rollout_max_prompt_len < cfg.rollout_max_context_len
