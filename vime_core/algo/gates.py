"""Decisions the step takes from the configuration alone: whether a reference model, critic or teacher
is needed, whether old log-probs can be reused, when the prefix cache is flushed."""

from __future__ import annotations

from typing import Sequence

from vime_core.algo import get_adv_estimator  # the populated registry


def needs_reference(cfg) -> bool:
    """A KL term uses the reference policy's log-probs: use_kl_loss (the loss's KL term) or kl_coef > 0
    (the token rewards' KL penalty)."""
    return bool(cfg.use_kl_loss) or cfg.kl_coef > 0


def needs_critic(cfg) -> bool:
    """The estimator's advantages need a value model's values (its registration's critic: ppo)."""
    return get_adv_estimator(cfg.advantage_estimator).critic


def needs_teacher(cfg) -> bool:
    """The trainer loads and forwards a frozen teacher (opd_teacher_load): use_opd and opd_type == "megatron"."""
    return bool(cfg.use_opd) and cfg.opd_type == "megatron"


def can_reuse_log_probs_in_loss(num_microbatches: Sequence[int], cfg) -> bool:
    """The old log-probs equal the current ones (detached) at the first forward of the only training step,
    so the recompute forward can be skipped, when ALL of these hold:

        len(num_microbatches) == 1            one optimizer step per rollout (the policy has not moved)
        loss_type == "policy_loss"
        not needs_reference(cfg)              no KL term needs the reference model's forward
        not use_opd                           distillation reads the old log-probs before the step
        not use_rollout_logprobs              old = engine log-probs is a different choice
        not get_mismatch_metrics              train-vs-rollout metrics need the recomputed ones
        not est.critic                        a critic's estimator (ppo) trains a value head too
        est.reuse_log_probs                   False where the loss takes the old log-probs as an input
                                              of its own (GSPO's sequence ratio)"""
    est = get_adv_estimator(cfg.advantage_estimator)
    return (
        len(num_microbatches) == 1
        and cfg.loss_type == "policy_loss"
        and not needs_reference(cfg)
        and not cfg.use_opd
        and not cfg.use_rollout_logprobs
        and not cfg.get_mismatch_metrics
        and not est.critic
        and est.reuse_log_probs
    )


def should_flush_cache(flush_cache_interval: int, new_version: int, initial_version: int = 0) -> bool:
    """The engines' prefix cache holds KV of the old weights: flush it on the first publish after v0 and
    then every `interval` versions: v == v0 + 1 or (v - v0 - 1) % interval == 0."""
    if flush_cache_interval < 1:
        raise ValueError(f"flush_cache_interval={flush_cache_interval} must be >= 1")
    if new_version <= initial_version:
        raise ValueError(f"new_version={new_version} must be after initial_version={initial_version}")
    if new_version == initial_version + 1:
        return True
    return (new_version - initial_version - 1) % flush_cache_interval == 0
