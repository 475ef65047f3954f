"""What every phase task shares: attaching to the run's actors, and when a failed task is retried."""

from __future__ import annotations

from prefect.cache_policies import NO_CACHE

from vime_core.cluster.connect import ensure_ray
from vime_core.config import VimeConfig
from vime_core.faults import pause_points


def retry_unless_configuration(task, task_run, state) -> bool:
    """Prefect's retry condition for every phase task: a configuration or data error fails the
    same way on every try (vime_core/faults.py), and so does a call to an actor that died (only
    bootstrap, before the iteration's retry, rebuilds it): neither is retried; anything else is."""
    from vime_core.faults import CONFIGURATION, actor_died, classify

    exc = state.data if isinstance(state.data, BaseException) else None
    return exc is None or not (actor_died(exc) or classify(exc).kind == CONFIGURATION)


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


def run_handles(cfg: VimeConfig):
    """(rollout_manager, trainer_group) of the run, attaching the driver to Ray if needed. The
    handles are looked up once per process and reused; a retried task looks them up afresh
    (an actor may have been replaced)."""
    ensure_ray(cfg.ray_address)
    from vime_core.cluster.run_actors import attach

    return attach(cfg, cached=first_try())
