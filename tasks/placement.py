"""Handing the devices back and forth between engines and trainer (colocated runs)."""

from __future__ import annotations

import time

import ray
from prefect import task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig


@task(name="offload-rollout", task_run_name="offload-rollout-{rollout_id}", retries=2, retry_delay_seconds=2, **TASK_DEFAULTS)
def offload_rollout(config: VimeConfig, rollout_id: int) -> float:
    """Engines sleep (level 2 when they receive weight updates, else 1); no-op unless offload_rollout."""
    t0 = time.perf_counter()
    if config.offload_rollout:
        manager, _ = run_handles(config)
        ray.get(manager.offload.remote())
    return time.perf_counter() - t0


@task(name="onload-weights", task_run_name="onload-weights-{rollout_id}", retries=2, retry_delay_seconds=2, **TASK_DEFAULTS)
def onload_weights(config: VimeConfig, rollout_id: int) -> float:
    """Wake the engines' weight memory before new weights are written into it."""
    t0 = time.perf_counter()
    if config.offload_rollout:
        manager, _ = run_handles(config)
        ray.get(manager.onload_weights.remote())
    return time.perf_counter() - t0


@task(name="onload-kv", task_run_name="onload-kv-{rollout_id}", retries=2, retry_delay_seconds=2, **TASK_DEFAULTS)
def onload_kv(config: VimeConfig, rollout_id: int) -> float:
    """Wake the engines' KV cache before the next rollout."""
    t0 = time.perf_counter()
    if config.offload_rollout:
        manager, _ = run_handles(config)
        ray.get(manager.onload_kv.remote())
    return time.perf_counter() - t0
