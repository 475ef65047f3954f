"""sync-v: publish the trainer's weights to every engine as version v (design phase sync)."""

from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig


@task(name="sync", task_run_name="sync-v{target_version}", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def sync_weights(config: VimeConfig, target_version: int, resume_admission: bool = True) -> dict:
    """Pause admission, publish (v -> target_version), resume admission. Idempotent: engines
    that already report `target_version` are not re-synced."""
    manager, trainers = run_handles(config)
    t0 = time.perf_counter()
    versions = ray.get(manager.weight_versions.remote())
    if versions and all(v == target_version for v in versions):
        get_run_logger().info("sync: engines already at v%d", target_version)
        return {"t_sync": time.perf_counter() - t0, "version": target_version, "skipped": True}
    urls = ray.get(manager.engine_urls.remote())
    ray.get(manager.pause_admission.remote())
    try:
        result = trainers.call("update_weights", urls, target_version)
    finally:
        if resume_admission:
            ray.get(manager.resume_admission.remote())
    stats = dict(result[0] or {}) if isinstance(result[0], dict) else {"version": result[0]}
    stats["t_sync"] = time.perf_counter() - t0
    return stats
