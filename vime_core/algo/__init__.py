"""The RL math of one step, in pure torch (no ray, HTTP or prefect): reward shaping, group reward
normalisation, advantage estimators, policy losses, KL estimators and the gates. Importing the
package registers the built-in estimators, so look estimators and losses up through here;
implementers import algo.registry only."""

from typing import Callable

from vime_core.algo import advantages as _builtin_estimators  # noqa: F401  (registers them; no torch)
from vime_core.algo import registry
from vime_core.algo.registry import (
    check_adv_estimator,
    describe_adv_estimators,
    get_adv_estimator,
    get_adv_estimator_fn,
    register_adv_est,
    register_policy_loss,
    registered_adv_estimators,
)


def _load_builtin_policy_losses() -> None:
    # boundary: the driver imports this package (the configuration's checks); algo.losses imports torch
    import vime_core.algo.losses  # noqa: F401  (registers them)


def get_policy_loss_fn(name: str) -> Callable:
    """The registered policy loss `name`, the built-in ones loaded first."""
    _load_builtin_policy_losses()
    return registry.get_policy_loss_fn(name)


def registered_policy_losses() -> list[str]:
    _load_builtin_policy_losses()
    return registry.registered_policy_losses()


__all__ = [
    "register_adv_est",
    "register_policy_loss",
    "get_adv_estimator",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "registered_adv_estimators",
    "registered_policy_losses",
    "check_adv_estimator",
    "describe_adv_estimators",
]
