"""sync-v: publish the trainer's weights to every engine as version v (design phase sync)."""

from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig


@task(name="sync", task_run_name="sync-v{target_version}", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def sync_weights(config: VimeConfig, target_version: int, resume_admission: bool = True,
                 start_rollout_id: int | None = None) -> dict:
    """Pause admission, publish (v -> target_version), resume admission and, when
    `start_rollout_id` is given (rollout_prefetch), start that rollout on the new weights in the
    same actor call. Idempotent: engines that already report `target_version` are not
    re-synced. Two RolloutManager calls around the publish (begin_sync, end_sync)."""
    manager, trainers = run_handles(config)
    t0 = time.perf_counter()
    urls = ray.get(manager.begin_sync.remote(target_version))  # None: engines already there
    try:
        result = trainers.call("update_weights", urls, target_version) if urls is not None else None
    except BaseException:
        ray.get(manager.end_sync.remote(resume_admission))
        raise
    started = ray.get(manager.end_sync.remote(resume_admission, start_rollout_id, target_version))
    if result is None:
        get_run_logger().info("sync: engines already at v%d", target_version)
        stats = {"version": target_version, "skipped": True}
    else:
        stats = dict(result[0] or {}) if isinstance(result[0], dict) else {"version": result[0]}
    stats["t_sync"] = time.perf_counter() - t0
    stats["started_rollout"] = started
    return stats
