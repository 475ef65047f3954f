"""No non-finite loss or gradient reaches the weights: such an optimizer step is skipped on every
rank, counted, and too many in a row stop the run.

For one optimizer step (the policy's or the critic's), on rank r after the micro-batches'
backward and Megatron's finalize_model_grads (the DP all-reduce of the gradients):

    f_r = 1  if the step's loss on r or the sum of any of its DDP gradient buffers is NaN or +-Inf
    f   = max_r f_r          one all-reduce of one float over the world group (every TP and DP
                             rank: a TP rank only sees its own shard of the gradients)
    f = 1    the step is skipped on every rank alike: no optimizer step (weights, Adam's moments
             and step count stay bit for bit), the gradient buffers are zeroed, the learning-rate
             schedule does not advance; the step counts in `skipped_steps`
    run      a finite step resets the count of skipped steps in a row; one more than
             max_skipped_steps in a row raises NonFiniteStepsError, naming the rollout id

A buffer's sum is NaN or Inf exactly when one of its elements is (or when the finite gradients
sum past fp32's 3e38, a broken step too); summing reads the buffer once and allocates nothing of
its size, where torch.isfinite(buffer).all() would allocate a bool per parameter. Megatron's own
check (a grad scaler's found_inf) exists only for fp16; with bf16 or fp32 a NaN gradient passes
its step as a success, and clipping does not clip a NaN norm.

NonFiniteStepsError is a ValueError: a data or training error that a second try of the iteration
would hit again (vime_core/faults.py does not retry it). The iteration fails before its
checkpoint and its publish, so the engines, the checkpoints and the stored batches keep what
they had.
"""

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
    """Whether the step's loss and gradients are finite on every rank (module docstring: f = 0);
    one all-reduce of one float, then one read-back."""
    # each sum in its buffer's dtype: a dtype argument would make a converted copy of the buffer
    values = [g.sum().double().reshape(1).to(device) for g in gradient_buffers(model)]
    values.append(torch.as_tensor(loss, dtype=torch.float64).to(device).reshape(1))
    flag = (~torch.isfinite(torch.cat(values))).any().to(torch.float32)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        # the default group: every trainer rank; on the trainer's device (NCCL reduces no CPU tensor)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return flag.item() == 0.0
