"""Handing the devices back and forth between engines and trainer (colocated runs)."""

from __future__ import annotations

import ray
from prefect import task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase
from vime_core.utils.timing import timed


def _engines(config: VimeConfig, method: str) -> dict:
    """One RolloutManager call (the flow calls these tasks only where engines sleep:
    vime_core.step_plan); its
    seconds and the engines' device memory afterwards."""
    with timed() as moving:
        manager, _ = run_handles(config)
        memory = ray.get(getattr(manager, method).remote())
    return {"seconds": moving.seconds, "memory": memory}


@task(
    name=Phase.OFFLOAD_ROLLOUT,
    task_run_name="offload-rollout-{rollout_id}",
    retries=2,
    retry_delay_seconds=2,
    **TASK_DEFAULTS,
)
def offload_rollout(config: VimeConfig, rollout_id: int) -> dict:
    """Engines sleep (level 2 when they receive weight updates, else 1)."""
    return _engines(config, "offload")


@task(
    name=Phase.OFFLOAD_TRAIN,
    task_run_name="offload-train-{rollout_id}",
    retries=2,
    retry_delay_seconds=2,
    **TASK_DEFAULTS,
)
def offload_train(config: VimeConfig, rollout_id: int) -> dict:
    """Every trainer rank moves its optimizer state and gradient buffers to host memory; the
    weights follow once the publish has copied them (MegatronTrainer.sleep)."""
    with timed() as moving:
        _, trainers = run_handles(config)
        per_rank = trainers.call("sleep", keep_weights=True)
    return {"seconds": moving.seconds, "memory": per_rank}


@task(
    name=Phase.ONLOAD_WEIGHTS,
    task_run_name="onload-weights-{rollout_id}",
    retries=2,
    retry_delay_seconds=2,
    **TASK_DEFAULTS,
)
def onload_weights(config: VimeConfig, rollout_id: int) -> dict:
    """Wake the engines' weight memory before new weights are written into it."""
    return _engines(config, "onload_weights")


@task(name=Phase.ONLOAD_KV, task_run_name="onload-kv-{rollout_id}", retries=2, retry_delay_seconds=2, **TASK_DEFAULTS)
def onload_kv(config: VimeConfig, rollout_id: int) -> dict:
    """Wake the engines' KV cache before the next rollout."""
    return _engines(config, "onload_kv")
