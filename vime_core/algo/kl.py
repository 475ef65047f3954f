"""KL estimators between the current policy and a reference (Schulman, "Approximating KL
Divergence", 2020). With log_ratio = log p(x) - log p_ref(x) for x sampled from p:

    k1 = log_ratio                                   unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio^2                           biased, low variance
    k3 = exp(-log_ratio) - 1 + log_ratio             unbiased, >= 0, low variance
    low_var_kl = clamp(k3, -10, 10)                  k3 with its tail cut (as verl/slime)
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_BOUND = 10.0


def compute_approx_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token KL estimate; the formulas are in the module docstring."""
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio**2
    if kl_type in ("k3", "low_var_kl"):
        k3 = torch.exp(-log_ratio) - 1 + log_ratio
        return k3 if kl_type == "k3" else torch.clamp(k3, -LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)
    raise ValueError(f"unknown kl_loss_type {kl_type!r}; known: {list(KL_TYPES)}")
