"""Name -> function registries for advantage estimators and policy losses (verl style).

    @register_adv_est("grpo")
    def grpo_advantages(...): ...

    get_adv_estimator_fn("grpo")   # -> grpo_advantages

Registering a name twice is an error (two modules silently fighting over one name is a bug);
asking for an unknown name raises `KeyError` listing the known ones.
"""

from __future__ import annotations

from typing import Callable, TypeVar

F = TypeVar("F", bound=Callable)

_ADV_ESTIMATORS: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _register(table: dict[str, Callable], kind: str, name: str) -> Callable[[F], F]:
    def decorator(fn: F) -> F:
        if name in table and table[name] is not fn:
            raise ValueError(f"{kind} {name!r} is already registered by {table[name].__module__}.{table[name].__qualname__}")
        table[name] = fn
        return fn

    return decorator


def _get(table: dict[str, Callable], kind: str, name: str) -> Callable:
    _ensure_builtins_loaded()
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def _ensure_builtins_loaded() -> None:
    # The built-in estimators/losses register themselves on import; a caller that imported only
    # this module must still find them.
    import vime_core.algo.advantages  # noqa: F401
    import vime_core.algo.losses  # noqa: F401


def register_adv_est(name: str) -> Callable[[F], F]:
    """Register an advantage estimator under `name` (the value of cfg.advantage_estimator)."""
    return _register(_ADV_ESTIMATORS, "advantage estimator", name)


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a policy loss under `name` (see vime_core.algo.losses.policy_loss_name)."""
    return _register(_POLICY_LOSSES, "policy loss", name)


def get_adv_estimator_fn(name: str) -> Callable:
    return _get(_ADV_ESTIMATORS, "advantage estimator", name)


def get_policy_loss_fn(name: str) -> Callable:
    return _get(_POLICY_LOSSES, "policy loss", name)


def registered_adv_estimators() -> list[str]:
    _ensure_builtins_loaded()
    return sorted(_ADV_ESTIMATORS)


def registered_policy_losses() -> list[str]:
    _ensure_builtins_loaded()
    return sorted(_POLICY_LOSSES)
