"""The run's engine token through Ray: made once when the run's actors are first created, then asked
from them by whoever comes later, never on disk (Ray is the trust boundary; docs/gpus-and-clusters.md).
Asked in order from the RolloutManager, then an engine actor; with neither, a new run gets a new
token (or the driver's VIME_ENGINE_TOKEN for servers vime does not start), so actors never hold two."""

from __future__ import annotations

from typing import Any, Optional

from vime_core.cluster import names
from vime_core.engines.auth import EngineToken

ASK_TIMEOUT_S = 120.0  # a RolloutManager still in its constructor (starting engines) answers after it


def _actor(name: str, run_name: str) -> Any:
    import ray

    try:
        return ray.get_actor(name, namespace=names.namespace(run_name))
    except ValueError:
        return None


def _ask(actor: Any) -> Optional[EngineToken]:
    import ray

    return ray.get(actor.engine_token.remote(), timeout=ASK_TIMEOUT_S)


def existing_engine_token(cfg: Any, num_engines: int) -> tuple[bool, Optional[EngineToken]]:
    """(found, token) from the run's RolloutManager or one of its `num_engines` engine actors;
    (False, None) when none of them exists."""
    for name in [names.ROLLOUT_MANAGER, *(names.engine(e) for e in range(num_engines))]:
        actor = _actor(name, cfg.run_name)
        if actor is not None:
            return True, _ask(actor)
    return False, None


def run_engine_token(cfg: Any, num_engines: int) -> Optional[EngineToken]:
    """The token the run's actors hold, or the one a new run starts with (module docstring)."""
    found, token = existing_engine_token(cfg, num_engines)
    if found:
        return token
    if cfg.engine_urls:
        return EngineToken.from_env()
    return EngineToken.new() if cfg.engine_auth else None


def manager_engine_token(cfg: Any) -> Optional[EngineToken]:
    """The RolloutManager's token (what a publisher sends), or None when Ray is not initialized
    in this process or the run has no RolloutManager (a trainer driven by hand, in tests)."""
    import ray

    if not ray.is_initialized():
        return None
    manager = _actor(names.ROLLOUT_MANAGER, cfg.run_name)
    return _ask(manager) if manager is not None else None
