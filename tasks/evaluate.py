"""eval-k: an eval rollout over the eval set, without touching the training data source."""

from __future__ import annotations

import ray
from prefect import task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase
from vime_core.utils.timing import timed


@task(name=Phase.EVAL, task_run_name="eval-{rollout_id}", retries=1, **TASK_DEFAULTS)
def evaluate(config: VimeConfig, rollout_id: int) -> dict:
    manager, _ = run_handles(config)
    with timed() as evaluating:
        result = dict(ray.get(manager.eval.remote(rollout_id)))
    return {**result, "t_eval": evaluating.seconds}
