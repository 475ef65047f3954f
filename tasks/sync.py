"""sync-v: publish the trainer's weights to every engine as version v (design phase sync)."""

from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, first_try, run_handles
from tasks.dispatch import Dispatched, settle
from vime_core.config import VimeConfig
from vime_core.step_protocol import Phase


@task(name=Phase.SYNC, task_run_name="sync-v{target_version}", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def sync_weights(config: VimeConfig, target_version: int, resume_admission: bool = True,
                 start_rollout_id: int | None = None, dispatched: Dispatched | None = None) -> dict:
    """Pause admission, publish (v -> target_version), resume admission and, when
    `start_rollout_id` is given (rollout_prefetch), start that rollout on the new weights in the
    same actor call. Idempotent: engines that already report `target_version` are not
    re-synced.

    `dispatched`: the publish the rollout task already submitted (tasks.dispatch); the first try
    waits for it and then only ends the sync. Otherwise (a retry, engines that sleep, or that
    publish failed) the three calls are submitted here, chained inside Ray by their object
    references (begin_sync's URLs -> every rank's update_weights -> end_sync), so no step waits
    for a round trip through this process."""
    manager, trainers = run_handles(config)
    log = get_run_logger()
    t0 = time.perf_counter()
    per_rank = None
    if dispatched is not None and first_try():
        try:
            per_rank = trainers.wait(dispatched.publish)
        except Exception as exc:  # e.g. training failed and was retried: publish what it trained
            settle(dispatched)  # every rank's failed call, not only the one raised
            log.warning("sync: the publish dispatched with the rollout failed (%s); publishing again", _what(exc))
    if per_rank is not None:
        started = ray.get(manager.end_sync.remote(resume_admission, start_rollout_id, target_version))
    else:
        per_rank, started = _publish_chained(manager, trainers, target_version, resume_admission, start_rollout_id)
    if per_rank[0] is None:
        log.info("sync: engines already at v%d", target_version)
        stats = {"version": target_version, "skipped": True}
    else:
        stats = dict(per_rank[0]) if isinstance(per_rank[0], dict) else {"version": per_rank[0]}
    stats["t_sync"] = time.perf_counter() - t0
    stats["started_rollout"] = started
    return stats


def _first_line(exc: BaseException) -> str:
    return next(iter(str(exc).splitlines()), "") or type(exc).__name__


def _what(exc: BaseException) -> str:
    """One line saying what failed: the remote error's own message, not Ray's call header."""
    from vime_core.faults import classify

    fault = classify(exc)
    return f"{fault.what} ({fault.error_type})"


def _publish_chained(manager, trainers, target_version: int, resume_admission: bool,
                     start_rollout_id: int | None) -> tuple[list, bool]:
    """(every rank's update_weights result, whether a rollout was started)."""
    urls = manager.begin_sync.remote(target_version)  # None: engines already there
    published = trainers.call_async("update_weights", urls, target_version)
    ended = manager.end_sync.remote(resume_admission, start_rollout_id, target_version, *published)
    try:
        per_rank = trainers.wait(published)
    except BaseException:
        # the chained end_sync does not run when a publish failed: open admission again
        ray.get(manager.end_sync.remote(resume_admission))
        _collect_failed(ended)
        raise
    return per_rank, ray.get(ended)


def _collect_failed(ref) -> None:
    """Take a chained call's error (the publish's, raised by the caller): a failed reference
    nobody gets is logged by Ray, with the remote traceback, once it is released."""
    try:
        ray.get(ref)
    except Exception:
        pass


@task(name=Phase.CHECK_WEIGHTS, task_run_name="check-weights-v{target_version}", **TASK_DEFAULTS)
def check_weight_update(config: VimeConfig, target_version: int, synced: dict) -> dict:
    """check_weight_update_equal: the engines' log-probs of the probe sequence against the
    trainer's (computed by the publish, before its weights were released), and against the
    engines' previous version (vime_core/weight_sync/weight_check). Runs once the engines'
    KV cache is awake. Logs and returns the comparison; it does not fail the iteration."""
    from vime_core.weight_sync.weight_check import compare

    probe = synced.get("probe")
    if not probe:
        return {}
    manager, _ = run_handles(config)
    try:
        engines, previous = ray.get(manager.probe_log_probs.remote(probe["tokens"]))
    except Exception as exc:  # a diagnostic: say so, do not fail the iteration
        first_line = _first_line(exc)
        get_run_logger().warning("check weights v%d: the engines could not score the probe: %s", target_version, first_line)
        return {"version": target_version, "error": first_line[:500]}
    result = {"version": target_version, **compare(probe["log_probs"], engines, previous)}
    get_run_logger().info("check weights v%d: max |engine - trainer| = %.4g%s", target_version, result["max_abs_diff"],
                          f", changed by up to {result['changed_max']:.4g} since the previous version" if "changed_max" in result else "")
    return result
