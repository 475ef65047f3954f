"""The RL math of one step, in pure torch: reward shaping, group reward normalisation, advantage
estimators, policy losses, KL estimators and the scheduling gates. Nothing here imports ray, HTTP or prefect.

Estimators and losses are registered by name (`register_adv_est`, `register_policy_loss`), so a
new one is one decorated function in its own module; an estimator's registration also carries its
group normalisation, its policy loss and its gate rules (registry.py). The built-in ones register
when first looked up; neither this package, `registry`, `advantages` nor `gates` imports torch
at import time.
"""

from vime_core.algo.registry import (
    get_adv_estimator,
    get_adv_estimator_fn,
    get_policy_loss_fn,
    register_adv_est,
    register_policy_loss,
)

__all__ = ["register_adv_est", "register_policy_loss", "get_adv_estimator", "get_adv_estimator_fn", "get_policy_loss_fn"]
