"""train-k: the trainer group trains on rollout k's batch (all DP ranks, one call each)."""

from __future__ import annotations

import time

from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig


@task(name="train", task_run_name="train-{rollout_id}", retries=1, retry_delay_seconds=5, **TASK_DEFAULTS)
def train(config: VimeConfig, rollout_id: int, batch_ref) -> dict:
    """Design phase train. Idempotent: a trainer that already trained this rollout id returns
    its recorded metrics without a second optimizer step."""
    _, trainers = run_handles(config)
    t0 = time.perf_counter()
    per_rank = trainers.call("train", rollout_id, batch_ref)
    metrics = dict(per_rank[0] or {})
    metrics["t_train"] = time.perf_counter() - t0
    if metrics.get("skipped"):
        get_run_logger().info("train %d: already trained, not training again", rollout_id)
    return metrics
