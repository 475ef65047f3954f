"""What every phase task shares: attaching to the run's actors, and when a failed task is retried."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from tasks.signals import stopped_by_signal
from vime_core.cluster.connect import ensure_ray
from vime_core.cluster.run_actors import AttachedHandles, attach
from vime_core.config import VimeConfig
from vime_core.faults import CONFIGURATION, DEVICE_MEMORY, classify, needs_bootstrap, pause_points
from vime_core.utils import interrupt


def retry_unless_configuration(task, task_run, state) -> bool:
    """Prefect's retry condition for every phase task: a configuration or data error, or a trainer
    call out of device memory, fails the same way on every try (vime_core/faults.py), and so does a
    call to an actor that died or holds a half-trained rollout, or a check that found engines a
    publish did not reach (only bootstrap, before the iteration's retry, rebuilds or publishes
    again: faults.needs_bootstrap): neither is retried; nor is anything
    once the process was told to stop (vime_core.faults.stopped_by_signal); anything else is."""
    return _retry(task, task_run, state, rebuilds_actors=False)


def retry_rebuilding_actors(task, task_run, state) -> bool:
    """bootstrap's retry condition: as retry_unless_configuration, but an actor that died is
    retried, since bootstrap's next try creates it again. A RolloutManager whose engine crashed at
    start (an infrastructure error: a device another process grew on while vLLM profiled its
    memory) dies in its constructor; its setting errors stay configuration (faults.classify)."""
    return _retry(task, task_run, state, rebuilds_actors=True)


NOT_RETRIED = (CONFIGURATION, DEVICE_MEMORY)  # the same try fails the same way


def _retry(task, task_run, state, rebuilds_actors: bool) -> bool:
    exc = state.data if isinstance(state.data, BaseException) else None
    if interrupt.received() is not None or (exc is not None and stopped_by_signal(exc)):
        return False
    retry = exc is None or not ((needs_bootstrap(exc) and not rebuilds_actors) or classify(exc).kind in NOT_RETRIED)
    if retry:
        _announce_retry(task, task_run, exc)
    return retry


RETRY_NOTICE = "failed ({error}); try {next} of {tries} in {delay:g} s"


def _announce_retry(task, task_run, exc) -> None:
    """One warning line on the console per retry (Prefect's own notice is INFO, below the
    console's level): which task, what failed, when the next try starts. Prefect asks the retry
    condition only while tries remain, so a True answer is a retry."""
    import logging

    if task is None:  # called outside Prefect (tests of the condition alone)
        return
    tries = task.retries + 1
    done = max(1, getattr(task_run, "run_count", 1) or 1)
    delays = task.retry_delay_seconds or 0
    delay = delays[min(done - 1, len(delays) - 1)] if isinstance(delays, (list, tuple)) else float(delays)
    error = f"{type(exc).__name__}: {exc}" if exc is not None else "a failed state"
    error = error.splitlines()[0] if error else error
    notice = RETRY_NOTICE.format(error=error[:300], next=done + 1, tries=tries, delay=delay)
    logging.getLogger("vime.retry").warning("%s %s", getattr(task_run, "name", task.name), notice)


# Phase tasks take actor handles and object references: nothing to hash or cache.
TASK_DEFAULTS = dict(cache_policy=NO_CACHE, persist_result=False, retry_condition_fn=retry_unless_configuration)

# The fault tests' pause points (vime_core/faults.PausePoints), read once; unset (the default),
# no hook is installed at all.
_PAUSE_POINTS = pause_points()


def pause_at_task_start(task, task_run, state) -> None:
    _PAUSE_POINTS.pause(task_run.name)


if _PAUSE_POINTS is not None:
    TASK_DEFAULTS["on_running"] = [pause_at_task_start]


def first_try() -> bool:
    """Whether the running task run is on its first try (Prefect counts from 1; 0 outside a run)."""
    from prefect.runtime import task_run

    return (task_run.run_count or 1) <= 1


# This driver's actor handles, reused by every phase task (vime_core/cluster/run_actors.py).
ATTACHED = AttachedHandles()


def run_handles(cfg: VimeConfig):
    """(rollout_manager, trainer_group) of the run, attaching the driver to Ray if needed. The
    handles are looked up once per process and reused; a retried task looks them up afresh
    (an actor may have been replaced)."""
    ensure_ray(cfg.ray_address)
    return attach(cfg, ATTACHED, reuse=first_try())
