"""Policy losses (per token), entropy, rollout importance weights and loss aggregation.

Per response token: ppo_kl = old_log_probs - log_probs (exactly 0 where loss_mask is 0, so a masked
ratio is 1), A = advantage, eps = eps_clip, eps_high = eps_clip_high, c = eps_clip_c.

    PPO clip (grpo, reinforce++, ppo; dual clip of Ye et al. 2020):
        ratio = exp(clamp(-ppo_kl, -20, 20))
        pg    = max(-ratio * A, -clip(ratio, 1 - eps, 1 + eps_high) * A);  min(pg, -c * A) where A < 0
    GSPO (Zheng et al. 2025): the same clip on the sequence ratio (prod_t pi/pi_old)^(1/|y_i|)
    CISPO (MiniMax-M1 2025): pg = -sg(min(ratio, 1 + eps_high)) * A * log_probs
    entropy: H = logsumexp(z) - sum_v softmax(z)_v z_v"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# The registry (a leaf) and not the package: the package's get_policy_loss_fn imports this module.
# The estimators policy_loss_name looks up are there all the same, since importing this module
# runs the package's __init__, which registers them.
from vime_core.algo.kl import masked_log_ratio
from vime_core.algo.registry import get_adv_estimator, register_policy_loss

PPO_LOG_RATIO_BOUND = 20.0  # |log ratio| before exp, as verl: exp(20) ~ 5e8, far from fp32's overflow
LOSS_AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


def compute_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip with optional dual clip -> (per_token_loss, clip_fraction per token as float)."""
    ratio = (-ppo_kl).clamp(-PPO_LOG_RATIO_BOUND, PPO_LOG_RATIO_BOUND).exp()
    pg_losses1 = -ratio * advantages
    pg_losses2 = -ratio.clamp(1 - eps_clip, 1 + eps_clip_high) * advantages
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    clip_fraction = torch.gt(pg_losses2, pg_losses1).float()
    if eps_clip_c is None:
        return clip_pg_losses1, clip_fraction
    if eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c={eps_clip_c} must be > 1")
    pg_losses3 = -eps_clip_c * advantages
    clip_pg_losses2 = torch.minimum(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, clip_fraction


def sequence_mean_kl(ppo_kl: torch.Tensor, loss_mask: torch.Tensor, response_lengths: Sequence[int]) -> torch.Tensor:
    """GSPO: each token gets its sequence's masked mean of ppo_kl (flat [sum T_i] in and out)."""
    _check_flat(ppo_kl, response_lengths, "ppo_kl")
    seq_ids, sums, counts = _per_sequence_sums(ppo_kl, loss_mask.to(ppo_kl.dtype), response_lengths)
    return (sums / counts.clamp_min(1))[seq_ids]


def compute_cispo_loss(
    ppo_kl: torch.Tensor, log_probs: torch.Tensor, advantages: torch.Tensor, eps_clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """pg = -sg(min(ratio, 1 + eps_high)) * A * log_probs -> (per_token_loss, clip_fraction)."""
    ratio = (-ppo_kl).exp()
    truncated = torch.clamp(ratio, max=1 + eps_clip_high).detach()
    return -truncated * advantages * log_probs, torch.gt(ratio, 1 + eps_clip_high).float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v over the last dimension."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, tis_clip: float) -> torch.Tensor:
    """w = sg(min(exp(old_log_probs - rollout_log_probs), tis_clip))."""
    return torch.clamp((old_log_probs - rollout_log_probs).exp(), max=tis_clip).detach()


IS_LEVELS = ("token", "sequence", "geometric")
IS_MODES = ("truncate", "mask")
IS_SAFETY_BOUND = 20.0


def rollout_is_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    level: str = "token",
    mode: str = "truncate",
    upper: float = 2.0,
    lower: Optional[float] = None,
) -> torch.Tensor:
    """w_t, detached; flat [sum T_i] in and out (slime's tis_level / tis_mode, verl's rollout_is).

    With log_r_t = old_log_probs - rollout_log_probs, m the loss mask, C = upper, c = lower or 1 / C:

        token:      s_t = log_r_t
        sequence:   s_t = sum_{t' in i} m_t' log_r_t'
        geometric:  s_t = sum_{t' in i} m_t' log_r_t' / sum_{t' in i} m_t'
        rho_t = exp(clamp(s_t, -20, 20))
        truncate (TIS, Yao et al. 2025):  w_t = sg(min(rho_t, C))
        mask (MIS, Liu et al. 2025):      w_t = sg(rho_t * [c <= rho_t <= C])"""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown importance-sampling level {level!r}; known: {list(IS_LEVELS)}")
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance-sampling mode {mode!r}; known: {list(IS_MODES)}")
    _check_flat(old_log_probs, response_lengths, "old_log_probs")
    log_ratio = old_log_probs.detach().float() - rollout_log_probs.float()
    if level == "token":
        s = log_ratio
    else:
        seq_ids, sums, counts = _per_sequence_sums(log_ratio, loss_mask.to(log_ratio.dtype), response_lengths)
        s = (sums if level == "sequence" else sums / counts.clamp_min(1))[seq_ids]
    rho = torch.exp(s.clamp(-IS_SAFETY_BOUND, IS_SAFETY_BOUND))
    if mode == "truncate":
        return rho.clamp(max=upper).detach()
    low = 1.0 / upper if lower is None else lower
    return (rho * ((rho >= low) & (rho <= upper)).to(rho.dtype)).detach()


def aggregate_loss(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    response_lengths: Optional[Sequence[int]] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Reduce a per-token loss l over the loss_mask m == 1 tokens (per sequence i):

        token_mean:               sum_{i,t} m l / sum_{i,t} m
        seq_mean_token_mean:      mean over sequences with sum_t m > 0 of (sum_t m l / sum_t m)
        seq_mean_token_sum:       mean_i of sum_t m l
        seq_mean_token_sum_norm:  seq_mean_token_sum / L, L = `scale` (loss_scale_factor, default
                                  rollout_max_response_len); with grpo_std_normalization=false this is
                                  Dr. GRPO (Liu et al. 2025, arXiv:2503.20783)

    `per_token` is either [B, T] (one row per sequence, padding masked out) or flat [sum T_i]
    with `response_lengths` giving each sequence's T_i."""
    if per_token.shape != loss_mask.shape:
        raise ValueError(f"per-token loss {tuple(per_token.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    mask = loss_mask.to(per_token.dtype)
    if mode == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp_min(1)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; known: {list(LOSS_AGG_MODES)}")
    if per_token.dim() == 2:
        seq_sums, seq_counts = (per_token * mask).sum(-1), mask.sum(-1)
    else:
        if response_lengths is None:
            raise ValueError(f"loss_agg_mode={mode} on a flat tensor needs response_lengths")
        _check_flat(per_token, response_lengths, "per-token loss")
        _, seq_sums, seq_counts = _per_sequence_sums(per_token, mask, response_lengths)
    if mode == "seq_mean_token_sum":
        return seq_sums.mean() if len(seq_sums) else per_token.sum() * 0
    if mode == "seq_mean_token_sum_norm":
        if scale is None or scale <= 0:
            raise ValueError(
                f"loss_agg_mode=seq_mean_token_sum_norm needs a positive scale (loss_scale_factor), got {scale}"
            )
        return seq_sums.mean() / scale if len(seq_sums) else per_token.sum() * 0
    # the mean over sequences with a trainable token, without reading anything back from the
    # device (no .any(), no boolean indexing: each would be a host sync per micro-batch); with
    # none, 0 that keeps the graph
    valid = (seq_counts > 0).to(per_token.dtype)
    return (seq_sums / seq_counts.clamp_min(1) * valid).sum() / valid.sum().clamp_min(1)


def _per_sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, response_lengths: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence id of each flat token, sum_t m*v per sequence, sum_t m per sequence)."""
    # The sequence ids are made on the host and copied without blocking (pinned memory; a plain
    # copy to the GPU waits for the device), so a micro-batch never waits here.
    device = values.device
    lengths = torch.as_tensor(list(response_lengths))
    seq_ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths, output_size=values.numel())
    if device.type == "cuda":
        seq_ids = seq_ids.pin_memory().to(device, non_blocking=True)
    elif device.type != "cpu":
        seq_ids = seq_ids.to(device)
    sums = torch.zeros(len(lengths), dtype=values.dtype, device=device).index_add(0, seq_ids, values * mask)
    counts = torch.zeros(len(lengths), dtype=values.dtype, device=device).index_add(0, seq_ids, mask)
    return seq_ids, sums, counts


def _check_flat(t: torch.Tensor, response_lengths: Sequence[int], name: str) -> None:
    if t.dim() != 1 or t.numel() != sum(response_lengths):
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; expected flat [{sum(response_lengths)}] = sum(response_lengths)"
        )


# ---- registered policy losses ------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossParams:
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    eps_clip_c: Optional[float] = None

    @classmethod
    def from_config(cls, cfg) -> "PolicyLossParams":
        return cls(cfg.eps_clip, cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip, cfg.eps_clip_c)


def policy_loss_name(advantage_estimator: str) -> str:
    """The registered policy loss an estimator trains with (its registration's policy_loss)."""
    return get_adv_estimator(advantage_estimator).policy_loss


# Common signature (flat tensors over the response tokens of a micro-batch, sum T_i long):
# (log_probs, old_log_probs, advantages, loss_mask, response_lengths, params) -> (loss, clipfrac)
# Each takes ppo_kl = masked_log_ratio(old, current, loss_mask): 0 on a masked token (ratio 1), so
# exp(-ppo_kl) cannot overflow there and poison the backward (kl.py states the rule).


@register_policy_loss("ppo")
def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    params: PolicyLossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip on the token ratio: compute_policy_loss(old - current, A, ...)."""
    ppo_kl = masked_log_ratio(old_log_probs, log_probs, loss_mask)
    return compute_policy_loss(ppo_kl, advantages, params.eps_clip, params.eps_clip_high, params.eps_clip_c)


@register_policy_loss("gspo")
def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    params: PolicyLossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clip on the sequence ratio: compute_policy_loss(sequence_mean_kl(old - current), A, ...)."""
    ppo_kl = sequence_mean_kl(masked_log_ratio(old_log_probs, log_probs, loss_mask), loss_mask, response_lengths)
    return compute_policy_loss(ppo_kl, advantages, params.eps_clip, params.eps_clip_high, params.eps_clip_c)


@register_policy_loss("cispo")
def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    response_lengths: Sequence[int],
    params: PolicyLossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO: compute_cispo_loss(old - current, current, A, eps_high)."""
    return compute_cispo_loss(
        masked_log_ratio(old_log_probs, log_probs, loss_mask), log_probs, advantages, params.eps_clip_high
    )
