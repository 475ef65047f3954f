"""The critic's clipped value loss and its explained variance (advantage_estimator=ppo). Per token, with
V the value head's estimate, V_old its estimate before this rollout's updates, R the GAE return and
eps = value_clip (PPO2's value clipping):

    V_clip = V_old + clip(V - V_old, -eps, eps),   l_t = 0.5 * max((V - R)^2, (V_clip - R)^2)
    EV     = 1 - Var(R - V) / Var(R)"""

from __future__ import annotations

from typing import Optional

import torch


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, value_clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(l_t, clipfrac_t) per token of the module docstring, clipfrac_t = 1 where the clipped term is the
    larger one; any shape, float32."""
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_sq = (values - returns) ** 2
    clipped_sq = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_sq, clipped_sq)
    return loss, (clipped_sq > unclipped_sq).float()


def explained_variance_from_moments(mean_r: float, mean_r2: float, mean_d: float, mean_d2: float) -> Optional[float]:
    """EV = 1 - Var(R - V) / Var(R) from the token means of R, R^2, D = R - V and D^2; None when
    the returns do not vary (EV is undefined: every return is the same)."""
    var_r = mean_r2 - mean_r * mean_r
    if var_r <= 1e-12:
        return None
    return 1.0 - (mean_d2 - mean_d * mean_d) / var_r
