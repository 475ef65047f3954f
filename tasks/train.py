"""train-k: the trainer group trains on rollout k's batch (all DP ranks, one call each)."""

from __future__ import annotations

from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, first_try, run_handles
from tasks.sync import Submitted
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase
from vime_core.utils.timing import timed


@task(name=Phase.TRAIN, task_run_name="train-{rollout_id}", retries=1, retry_delay_seconds=5, **TASK_DEFAULTS)
def train(config: VimeConfig, rollout_id: int, batch_ref, submitted: Submitted | None = None) -> dict:
    """The train phase. `submitted`: the calls the flow submitted on this batch right after
    the rollout (tasks.sync.train_then_publish); the first try waits for their training, a retry
    calls the trainer afresh. Idempotent: a trainer that already trained this rollout id returns its recorded
    metrics without a second optimizer step."""
    _, trainers = run_handles(config)
    with timed() as training:
        if submitted is not None and first_try():
            per_rank = trainers.wait(submitted.train)
        else:
            per_rank = trainers.call("train", rollout_id, batch_ref)
    metrics = dict(per_rank[0] or {})
    metrics["t_train"] = training.seconds
    if metrics.get("skipped"):
        get_run_logger().info("train %d: already trained, not training again", rollout_id)
    return metrics
