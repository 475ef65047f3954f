"""The MoE router's losses in vime's training step. Megatron's router adds each loss's gradient in
its own backward (``MoEAuxLossAutoScaler``) at a scale Megatron's schedule normally sets; vime
computes the policy loss itself, so it sets that scale to the micro-batch's weight in the step, and
reads the values Megatron's tracker recorded (``moe_utils``) for the step's metrics."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.moe_utils import (
    MoEAuxLossAutoScaler,
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

# Megatron's tracker name -> vime's metric (both load-balancing types are one metric: one is in use)
METRIC_OF_TRACKED = {
    "load_balancing_loss": "moe_aux_loss",
    "seq_load_balancing_loss": "moe_aux_loss",
    "z_loss": "moe_z_loss",
}


def router_loss_metrics(cfg: Any) -> tuple[str, ...]:
    """The metrics the run's router losses log (none while both coefficients are 0)."""
    names = ("moe_aux_loss",) if cfg.moe_aux_loss_coeff > 0 else ()
    return names + (("moe_z_loss",) if cfg.moe_z_loss_coeff > 0 else ())


def set_router_loss_weight(weight: float) -> None:
    """Scale the next backward's router-loss gradients by ``weight``, the factor the micro-batch's
    policy loss is multiplied by before its backward: the router losses then enter the step's loss as
    sum_m weight_m * coeff * sum_layers loss_l(B_m), averaged over DP like the policy loss."""
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(weight)))


def take_router_losses() -> dict[str, torch.Tensor]:
    """Each router loss of the forwards since the last call, without its coefficient, as the mean over
    the model's layers (every layer is an MoE layer: model.py); clears Megatron's tracker. The values
    stay on the device. Call after the backward: with activation recompute the router's losses are
    computed in the backward's recompute (the first forward runs without grad, which skips them)."""
    out: dict[str, torch.Tensor] = {}
    for name, entry in get_moe_layer_wise_logging_tracker().items():
        metric = METRIC_OF_TRACKED.get(name)
        if metric is not None:
            values = entry["values"]
            out[metric] = out.get(metric, 0.0) + values.detach().double().sum() / values.numel()
    clear_aux_losses_tracker()
    return out
