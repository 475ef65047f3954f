"""The optimizer's, schedule's and activation recompute's configuration, called from `derive_in_place`:
lr_decay_iters = the policy's optimizer steps when unset, warmup from lr_warmup_iters or
lr_warmup_fraction, recompute defaults; and checks that refuse, before anything starts, what
Megatron's OptimizerParamScheduler would assert later."""

from __future__ import annotations

from vime_core.config.schema import ConfigFields  # the fields these functions read

# Options whose Megatron code paths need CUDA tensors (checked on a CPU trainer: Megatron's
# checkpointed forward reads the CUDA RNG state; the distributed optimizer accepts only
# torch.cuda.*Tensor parameters).
GPU_ONLY = ("recompute_granularity", "use_distributed_optimizer")


def critic_only_steps(cfg: ConfigFields) -> int:
    """The critic's optimizer steps before the policy's first (num_critic_only_steps rollouts)."""
    return cfg.num_critic_only_steps * cfg.num_steps_per_rollout


def total_optimizer_steps(cfg: ConfigFields) -> int:
    """The policy's optimizer steps: (num_rollout - num_critic_only_steps) * num_steps_per_rollout (the
    critic-only rollouts do not step the policy, nor its schedule)."""
    return cfg.num_rollout * cfg.num_steps_per_rollout - critic_only_steps(cfg)


def lr_warmup_steps(cfg: ConfigFields) -> float:
    """Warmup steps of the schedule. As in Megatron, a fraction is of the decay steps and is not
    rounded (the scheduler compares step counts with it)."""
    if cfg.lr_warmup_fraction is not None:
        return cfg.lr_warmup_fraction * cfg.lr_decay_iters
    return cfg.lr_warmup_iters


def derive_optimizer(cfg: ConfigFields) -> None:
    """Fill lr_decay_iters and the recompute defaults; raise ValueError naming the fields of a
    contradiction. Needs num_steps_per_rollout derived."""
    if cfg.num_critic_only_steps >= cfg.num_rollout:
        raise ValueError(
            f"num_critic_only_steps={cfg.num_critic_only_steps} leaves the policy no rollout to train on "
            f"(num_rollout={cfg.num_rollout})"
        )
    total = total_optimizer_steps(cfg)
    if cfg.lr_decay_iters is None:
        cfg.lr_decay_iters = total
    if cfg.lr_warmup_fraction is not None and cfg.lr_warmup_iters:
        raise ValueError(
            f"lr_warmup_iters={cfg.lr_warmup_iters} and lr_warmup_fraction={cfg.lr_warmup_fraction} "
            "are both set; set only one of them"
        )
    if cfg.min_lr > cfg.lr:
        raise ValueError(f"min_lr={cfg.min_lr} is above lr={cfg.lr}; the decay goes from lr down to min_lr")
    if cfg.lr_warmup_init > cfg.lr:
        raise ValueError(f"lr_warmup_init={cfg.lr_warmup_init} is above lr={cfg.lr}; warmup rises from it to lr")
    warmup = lr_warmup_steps(cfg)
    warmup_field = "lr_warmup_fraction" if cfg.lr_warmup_fraction is not None else "lr_warmup_iters"
    if warmup > total:
        raise ValueError(
            f"{warmup_field} gives {warmup:g} warmup steps, more than the policy's {total} optimizer steps "
            f"((num_rollout={cfg.num_rollout} - num_critic_only_steps={cfg.num_critic_only_steps}) * "
            f"num_steps_per_rollout={cfg.num_steps_per_rollout})"
        )
    if warmup >= cfg.lr_decay_iters:
        raise ValueError(
            f"{warmup_field} gives {warmup:g} warmup steps, not fewer than lr_decay_iters={cfg.lr_decay_iters} "
            "(the decay steps count the warmup; default: the policy's optimizer steps)"
        )

    if cfg.recompute_granularity == "full":
        if cfg.recompute_method is None:
            cfg.recompute_method = "uniform"
        if cfg.recompute_num_layers is None:
            cfg.recompute_num_layers = 1
    else:
        for name in ("recompute_method", "recompute_num_layers"):
            if getattr(cfg, name) is not None:
                raise ValueError(
                    f"{name}={getattr(cfg, name)} needs recompute_granularity=full (it is {cfg.recompute_granularity})"
                )

    if cfg.device == "cpu":
        for name in GPU_ONLY:
            if getattr(cfg, name):
                raise ValueError(
                    f"{name}={getattr(cfg, name)} needs device=cuda: Megatron's code for it runs on "
                    "CUDA tensors only (the CPU trainer keeps all activations and a plain fp32 Adam)"
                )
