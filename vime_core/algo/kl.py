"""KL estimators between the current policy and a reference (Schulman, "Approximating KL
Divergence", 2020). With x sampled from p, m the loss mask and

    log_ratio = where(m > 0, log p(x) - log p_ref(x), 0)          (masked_log_ratio)
    s         = clamp(log_ratio, -20, 20)                         (verl's bound, before exp)

the per-token estimates are

    k1 = log_ratio                                   unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio^2                           biased, low variance
    k3 = exp(-s) - 1 + s                             >= 0, low variance; unbiased (Schulman's k3)
                                                     where |log_ratio| <= 20, which it equals
    low_var_kl = clamp(k3, -10, 10)                  k3 with its tail cut (as verl/slime)

The rule: no KL form overflows and a token with loss mask 0 (a tool output, padding) cannot
poison the step. exp only ever sees s in [-20, 20], so k3's value and its derivative -exp(-s) + 1
are finite (a log-ratio of -91 alone would give exp(91) = inf in fp32, and in the backward
0 * inf = NaN even for a token the loss multiplies by 0). k1 and k2 have no exp: they are finite
for finite log-probs. A masked token's log-ratio is replaced by 0 with torch.where, not multiplied
by 0, so its KL is exactly 0 in every form and no gradient reaches its log-probs, whatever they
are. The same masking guards every other log-ratio a loss exponentiates (losses.py, ppo_kl).
"""

from __future__ import annotations

from typing import Optional

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_BOUND = 10.0
LOG_RATIO_BOUND = 20.0


def masked_log_ratio(
    log_p: torch.Tensor, log_q: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """where(m > 0, log_p - log_q, 0) (no mask: log_p - log_q): a masked token gets exactly 0
    and no gradient, whatever log_p and log_q hold there."""
    log_ratio = log_p - log_q
    if loss_mask is None:
        return log_ratio
    return torch.where(loss_mask.to(log_ratio.device) > 0, log_ratio, torch.zeros_like(log_ratio))


def compute_approx_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str, loss_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Per-token KL estimate; the formulas and the masking rule are in the module docstring.
    ``loss_mask`` (same shape): tokens with 0 get a KL of exactly 0."""
    log_ratio = masked_log_ratio(log_probs.float(), ref_log_probs.float(), loss_mask)
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio**2
    if kl_type in ("k3", "low_var_kl"):
        s = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        k3 = torch.exp(-s) - 1 + s
        return k3 if kl_type == "k3" else torch.clamp(k3, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"unknown kl_loss_type {kl_type!r}; known: {list(KL_TYPES)}")
