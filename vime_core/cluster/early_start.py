"""`vime train`'s early start: the run's actors are created, the engines start and the trainer
loads its weights in a thread while the first flow run starts Prefect's server; bootstrap then
claims what was started instead of starting it (`run_actors.start_actors` does either).
"""

from __future__ import annotations

import concurrent.futures
import logging
from typing import Optional

from vime_core.cluster.connect import ensure_ray
from vime_core.cluster.run_actors import RunActors, start_actors
from vime_core.config import VimeConfig
from vime_core.run_assets import resolve_run_config

log = logging.getLogger("vime.bootstrap")

# run name -> its start_actors call, running in a thread
_EARLY: dict[str, concurrent.futures.Future] = {}


def start_actors_early(cfg: VimeConfig) -> bool:
    """`vime train`, before its first flow run (early_start): resolve the configuration as the
    flow does and begin `start_early`. Anything that stops it here (a missing file, no cluster)
    is left to the flow, which fails on it with its usual one line: False."""
    try:
        resolved = resolve_run_config(cfg)
    except Exception:
        return False
    return start_early(resolved)


def start_early(config: VimeConfig) -> bool:
    """Begin `start_actors(config)` in a thread. `config` is the resolved one
    (vime_core.run_assets.resolve_run_config), as bootstrap gets it. False when the cluster
    cannot be reached: bootstrap then says why, as without it."""
    try:
        ensure_ray(config.ray_address)  # in the main thread, not the worker's
    except Exception as exc:
        log.debug("no early start: %s", exc)
        return False
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vime-early-start")
    _EARLY[config.run_name] = pool.submit(start_actors, config)
    pool.shutdown(wait=False)
    return True


def claim_early(config: VimeConfig) -> Optional[RunActors]:
    """What `start_early` started for this run (once), or None: nothing was started early, or
    it failed (bootstrap then starts the actors itself, and fails the way it would have). The
    actors are the run's whatever configuration started them, as when bootstrap attaches to the
    actors of an earlier driver."""
    future = _EARLY.pop(config.run_name, None)
    if future is None:
        return None
    try:
        return future.result()
    except Exception as exc:
        log.warning("starting the actors early failed (%s); starting them now", exc)
        return None


def early_marks(early: Optional[RunActors]) -> dict[str, float]:
    """When the early start began and when its actors were created, seconds since the command;
    empty without an early start."""
    if early is None or early.began_s is None:
        return {}
    return {"early_start": early.began_s, "early_actors_created": early.began_s + early.seconds}
