"""Megatron's optimizer (AdamW over its standard parameter groups) and learning-rate schedule for one
trainer rank, and their checkpoint state. The schedule, in optimizer steps n (step n runs at lr(n)):

    lr(n) = lr_warmup_init + (lr - lr_warmup_init) * n / W        n <= W (W > 0)
          = lr                                                    n > W, constant
          = min_lr + (lr - min_lr) * c(r),  r = (n - W) / (D - W)  W < n <= D
          = min_lr                                                n > D

c(r) = 1 - r (linear) or (1 + cos(pi r)) / 2 (cosine), W the warmup steps, D = lr_decay_iters."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging

from vime_core.config.optimizer import lr_warmup_steps

log = logging.getLogger(__name__)

# Keys of Megatron's parameter groups that its scheduler reads, set from this run's configuration
# (torch's load_state_dict would bring back the checkpoint's).
GROUP_SCHEDULE_KEYS = ("max_lr", "min_lr")


def ddp_config(cfg: Any) -> Any:
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=cfg.use_distributed_optimizer
    )


def optimizer_config(cfg: Any, dtype: torch.dtype) -> Any:
    return OptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_distributed_optimizer=cfg.use_distributed_optimizer,
    )


def build_optimizer(cfg: Any, model: Any, dtype: torch.dtype) -> Any:
    """Megatron's optimizer over the DDP-wrapped ``model`` (a ChainedOptimizer of its parts)."""
    return get_megatron_optimizer(optimizer_config(cfg, dtype), [model], use_gloo_process_groups=False)


def build_scheduler(cfg: Any, optimizer: Any) -> Any:
    """Megatron's scheduler at step 0 (it sets the first step's lr on the parameter groups)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=cfg.lr_warmup_init,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=lr_warmup_steps(cfg),
        lr_decay_steps=cfg.lr_decay_iters,
        lr_decay_style=cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=cfg.lr_decay_iters,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )


def current_lr(optimizer: Any) -> float:
    """The learning rate the next optimizer step uses (the schedule's, on the default groups)."""
    lr = get_canonical_lr_for_logging(optimizer.param_groups)
    return float(lr if lr is not None else optimizer.param_groups[0]["lr"])


# ---- checkpoint state ----------------------------------------------------------------------------


def _parts(optimizer: Any) -> list[Any]:
    return getattr(optimizer, "chained_optimizers", [optimizer])


def _distributed_parts(optimizer: Any) -> list[Any]:
    return [p for p in _parts(optimizer) if isinstance(p, DistributedOptimizer)]


def _before_first_step(part: Any) -> bool:
    """A distributed part whose Adam holds no state yet: Megatron's DistributedOptimizer.state_dict()
    then fails (without Apex or Transformer Engine it asserts one step count across the states)."""
    return isinstance(part, DistributedOptimizer) and not part.optimizer.state


def _state_dict(optimizer: Any) -> Any:
    """optimizer.state_dict(); when a distributed part has not stepped yet (a critic-only rollout
    leaves the policy's so), one entry per part, None for such a part."""
    parts = _parts(optimizer)
    if not any(_before_first_step(p) for p in parts):
        return optimizer.state_dict()
    return [None if _before_first_step(p) else p.state_dict() for p in parts]


def _load_state_dict(optimizer: Any, saved: Any) -> None:
    """What ``_state_dict`` made back into ``optimizer``; a part saved as None starts with no Adam
    state, as it was (its main parameters come from the shards)."""
    parts = _parts(optimizer)
    if not (isinstance(saved, list) and any(s is None for s in saved) and len(saved) == len(parts)):
        optimizer.load_state_dict(saved)
        return
    for part, entry in zip(parts, saved):
        if entry is None:
            part.optimizer.state.clear()
        else:
            part.load_state_dict(entry)


def _shard_params(part: Any) -> list[Any]:
    """The model parameters that own a shard on this rank, in the distributed optimizer's order."""
    return [
        param
        for buffer_ranges in part.gbuf_ranges
        for bucket_ranges in buffer_ranges.values()
        for bucket in bucket_ranges
        for param in bucket["param_map"]
    ]


def optimizer_state(optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """What a rank's checkpoint keeps of the optimizer and its schedule.

    Under the distributed optimizer it includes this rank's shard of the fp32 main parameters and Adam's
    moments, which DistributedOptimizer.state_dict() leaves out; each rank restores its own shard."""
    state: dict[str, Any] = {"optimizer": _state_dict(optimizer), "scheduler": scheduler.state_dict()}
    parts = _distributed_parts(optimizer)
    if parts:
        state["optimizer_shards"] = [
            [
                {k: v.detach().to("cpu", copy=True) for k, v in part._get_main_param_and_optimizer_states(p).items()}
                for p in _shard_params(part)
            ]
            for part in parts
        ]
    return state


def load_optimizer_state(optimizer: Any, state: dict[str, Any], where: str) -> None:
    """Restore what ``optimizer_state`` kept (not the scheduler: ``restore_scheduler``)."""
    kept = [{k: g[k] for k in GROUP_SCHEDULE_KEYS if k in g} for g in optimizer.param_groups]
    _load_state_dict(optimizer, state["optimizer"])
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)
    parts = _distributed_parts(optimizer)
    shards = state.get("optimizer_shards")
    if not parts:
        return
    if shards is None or len(shards) != len(parts):
        raise ValueError(
            f"{where}: no distributed-optimizer shards for this rank (saved without use_distributed_optimizer?)"
        )
    for part, saved in zip(parts, shards):
        own_step_counters(part.optimizer)
        params = _shard_params(part)
        if len(saved) != len(params):
            raise ValueError(f"{where}: {len(saved)} distributed-optimizer shards, this rank owns {len(params)}")
        # no_grad: an fp32 parameter's main shard is a view of the parameter itself (a leaf that
        # requires grad), which autograd refuses to copy into
        with torch.no_grad():
            for param, tensors in zip(params, saved):
                if set(tensors) == {"param"}:  # saved before the first step: Adam had no state yet
                    part._get_main_param_and_optimizer_states(param)["param"].copy_(tensors["param"])
                else:
                    part._set_main_param_and_optimizer_states(param, tensors)


def own_step_counters(optimizer: Any) -> None:
    """Give each parameter's state its own ``step`` tensor. DistributedOptimizer.load_state_dict
    (without Apex or Transformer Engine: torch's Adam, which keeps ``step`` per parameter) puts ONE
    tensor in every state; Adam's ``step += 1`` per parameter would then count each step once per
    parameter, and the bias corrections 1 - beta^step of the steps after a resume would be wrong."""
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def restore_scheduler(scheduler: Any, state: Optional[dict[str, Any]], optimizer_steps: int, where: str) -> None:
    """Bring a freshly built scheduler to the checkpoint's step. This run's settings win over the
    checkpoint's (Megatron's override_opt_param_scheduler, so a longer run may extend the decay) and a
    changed setting is logged; a checkpoint without a schedule starts it at its optimizer step count."""
    if state is None:
        log.info(
            "%s holds no learning-rate schedule (written before it was saved): the schedule starts at "
            "the checkpoint's optimizer step count, %d",
            where,
            optimizer_steps,
        )
        scheduler.step(optimizer_steps)
        return
    mine = scheduler.state_dict()
    changed = {k: (state[k], v) for k, v in mine.items() if k != "num_steps" and k in state and state[k] != v}
    if changed:
        log.warning(
            "%s: this run's learning-rate schedule differs from the checkpoint's (%s); continuing from "
            "step %d with this run's settings",
            where,
            ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()),
            state["num_steps"],
        )
    scheduler.load_state_dict(state)
