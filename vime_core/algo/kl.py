"""KL estimators between the current policy and a reference (Schulman, "Approximating KL Divergence",
2020). With x sampled from p and m the loss mask:

    log_ratio  = where(m > 0, log p(x) - log p_ref(x), 0),   s = clamp(log_ratio, -20, 20)
    k1 = log_ratio,   k2 = 0.5 * log_ratio^2,   k3 = exp(-s) - 1 + s,   low_var_kl = clamp(k3, -10, 10)

The rule: no form overflows (exp only sees s in [-20, 20]), and a masked token's log-ratio is
replaced by 0 with torch.where, not multiplied by 0, so its KL is exactly 0 and no gradient (no
0 * inf = NaN) reaches its log-probs. The same masking guards every log-ratio a loss exponentiates."""

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
