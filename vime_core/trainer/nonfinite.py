"""No non-finite loss or gradient reaches the weights: such an optimizer step is skipped on every rank
(weights, Adam's moments, step count and schedule stay), counted, and more than max_skipped_steps
in a row raise NonFiniteStepsError, a ValueError the train flow does not retry. Megatron's own check
exists only for fp16; with bf16 or fp32 a NaN gradient would pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


class NonFiniteStepsError(ValueError):
    """Too many optimizer steps in a row had a non-finite loss or gradient (one line)."""


@dataclass
class SkipCounter:
    """Skipped steps of one optimizer (`whose`: "policy" or "critic"): in a row across rollouts,
    and in the rollout being trained (`skipped`, its metric)."""

    max_skipped_steps: int
    whose: str = "policy"
    rollout_id: Optional[int] = None
    in_a_row: int = 0
    skipped: int = 0
    applied: int = 0
    """Steps of the rollout being trained that were applied (finite)."""

    def begin(self, rollout_id: int) -> None:
        """A new rollout: its counts start at 0 (the count in a row goes on)."""
        self.rollout_id, self.skipped, self.applied = rollout_id, 0, 0

    def record(self, skipped: bool) -> None:
        """After each step: a finite one resets the count in a row, a skipped one adds to both
        and raises once there are more than max_skipped_steps in a row."""
        if not skipped:
            self.in_a_row = 0
            self.applied += 1
            return
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row > self.max_skipped_steps:
            rollout = f"rollout {self.rollout_id}" if self.rollout_id is not None else "training"
            raise NonFiniteStepsError(
                f"{rollout}: {self.in_a_row} {self.whose} optimizer steps in a row had a non-finite loss or "
                f"gradient (max_skipped_steps={self.max_skipped_steps}); none was applied: the weights are those "
                f"from before them, no checkpoint is written for this rollout; look for a NaN reward or advantage, "
                f"extreme log-probs or too high an lr"
            )


def gradient_buffers(model: Any) -> list[torch.Tensor]:
    """The contiguous gradient buffers of a Megatron DDP model (`grad_data` of its dense and expert
    buffers: lists that shadow nn.Module.buffers); for another module, its parameters' gradients."""
    dense, expert = getattr(model, "buffers", None), getattr(model, "expert_parallel_buffers", None)
    if isinstance(dense, list):
        return [b.grad_data for b in dense + list(expert or [])]
    grads = [getattr(p, "main_grad", None) for p in model.parameters()]
    return [
        g if g is not None else p.grad for g, p in zip(grads, model.parameters()) if g is not None or p.grad is not None
    ]


def step_is_finite(model: Any, loss: Any, device: Any) -> bool:
    """Whether the step's loss and gradients are finite on every rank; call after finalize_model_grads.

        f_r = 1 if the loss on rank r or the sum of any of its DDP gradient buffers is NaN or +-Inf
        f   = max_r f_r     (one all-reduce over the world group: a TP rank sees only its shard)

    A buffer's sum reads it once and allocates nothing of its size (isfinite would allocate a bool per
    parameter); finite gradients summing past fp32's range are a broken step too."""
    # each sum in its buffer's dtype: a dtype argument would make a converted copy of the buffer
    values = [g.sum().double().reshape(1).to(device) for g in gradient_buffers(model)]
    values.append(torch.as_tensor(loss, dtype=torch.float64).to(device).reshape(1))
    flag = (~torch.isfinite(torch.cat(values))).any().to(torch.float32)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # the default group: every trainer rank; on the trainer's device (NCCL reduces no CPU tensor)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0
