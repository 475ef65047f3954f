"""Name -> advantage estimator and name -> policy loss registries (verl style): an estimator is one
`register_adv_est` carrying everything the rest of vime asks of it (group normalisation, policy
loss, gates, configuration checks). A leaf without torch: implementers register when imported, so
the configuration (and `vime --help`) reads the registered names without importing them."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

F = TypeVar("F", bound=Callable)

GroupNormalisation = Literal["mean_std", "mean", "leave_one_out", "none"]


@dataclass(frozen=True)
class AdvEstimator:
    """One registered advantage estimator (see algo.advantages for the formulas)."""

    name: str
    fn: Callable
    """(rewards[B], loss_masks: list[T_i], *, kl, values, gamma, lambd, kl_coef[, reduce_sums]) ->
    (advantages, returns); an estimator that whitens declares `reduce_sums`, the DP reducer of its
    sums (algo.advantages.masked_whiten), and is passed it; one without it is not."""
    group_normalisation: GroupNormalisation = "none"
    """Of the scalar rewards of one group, once per rollout: mean_std: (r - mean) / (std + 1e-6)
    (only centred when grpo_std_normalization is off or the group has one sample); mean: r - mean;
    leave_one_out: r_i - mean of the group's other rewards (0 in a group of one); none: r."""
    policy_loss: str = "ppo"
    """The registered policy loss it trains with."""
    token_rewards: bool = False
    """Its advantages come from per-token rewards, where kl_coef's KL penalty goes; an estimator
    without them refuses kl_coef > 0 (the KL term of the loss is use_kl_loss)."""
    reuse_log_probs: bool = True
    """At a rollout's only optimizer step the detached current log-probs may stand for the old ones;
    False when the policy loss needs the old log-probs as an input of its own (GSPO's sequence
    ratio)."""
    critic: bool = False
    """Needs a value head: the trainer builds a critic beside the policy (trainer/critic.py), whose
    values of the rollout's samples reach the estimator as `values`."""
    summary: str = ""
    """A few words shown beside its name in the configuration's description (the paper it comes from)."""


_ADV_ESTIMATORS: dict[str, AdvEstimator] = {}
_POLICY_LOSSES: dict[str, Callable] = {}


def _add(table: dict, kind: str, name: str, entry, fn: Callable) -> None:
    known = table.get(name)
    if known is not None:
        known_fn = known.fn if isinstance(known, AdvEstimator) else known
        if known_fn is not fn:
            raise ValueError(f"{kind} {name!r} is already registered by {known_fn.__module__}.{known_fn.__qualname__}")
    table[name] = entry


def _get(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)}") from None


def register_adv_est(
    name: str,
    *,
    group_normalisation: GroupNormalisation = "none",
    policy_loss: str = "ppo",
    token_rewards: bool = False,
    reuse_log_probs: bool = True,
    critic: bool = False,
    summary: str = "",
) -> Callable[[F], F]:
    """Register the decorated per-token advantage function as estimator `name` (a value of
    cfg.advantage_estimator) with what it needs elsewhere (the fields of AdvEstimator).

    For example `@register_adv_est("grpo", group_normalisation="mean_std", policy_loss="ppo",
    summary="Shao et al. 2024")`. Registering a name twice is an error; an unknown name raises KeyError
    listing the known ones."""
    if group_normalisation not in typing.get_args(GroupNormalisation):
        raise ValueError(
            f"advantage estimator {name!r}: group_normalisation={group_normalisation!r}; "
            f"one of {', '.join(map(repr, typing.get_args(GroupNormalisation)))}"
        )

    def decorator(fn: F) -> F:
        spec = AdvEstimator(name, fn, group_normalisation, policy_loss, token_rewards, reuse_log_probs, critic, summary)
        _add(_ADV_ESTIMATORS, "advantage estimator", name, spec, fn)
        return fn

    return decorator


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Register a policy loss under `name` (an estimator's `policy_loss`)."""

    def decorator(fn: F) -> F:
        _add(_POLICY_LOSSES, "policy loss", name, fn, fn)
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvEstimator:
    return _get(_ADV_ESTIMATORS, "advantage estimator", name)


def get_adv_estimator_fn(name: str) -> Callable:
    return get_adv_estimator(name).fn


def get_policy_loss_fn(name: str) -> Callable:
    return _get(_POLICY_LOSSES, "policy loss", name)


def registered_adv_estimators() -> list[str]:
    return sorted(_ADV_ESTIMATORS)


def registered_policy_losses() -> list[str]:
    return sorted(_POLICY_LOSSES)


def check_adv_estimator(name: str) -> str:
    """`name` when it is a registered estimator (the configuration's check of advantage_estimator);
    ValueError naming the registered ones otherwise."""
    if name not in registered_adv_estimators():
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {registered_adv_estimators()}")
    return name


def describe_adv_estimators() -> str:
    """The registered estimators with their summaries: 'cispo (MiniMax-M1 2025), gspo (...), ...'."""
    specs = [get_adv_estimator(n) for n in registered_adv_estimators()]
    return ", ".join(f"{s.name} ({s.summary})" if s.summary else s.name for s in specs)
