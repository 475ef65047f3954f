"""Train one rollout on this rank: DP partition, old / reference / teacher log-probs and values,
advantages over the whole step, then `num_steps` optimizer steps (the critic's first)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Sequence

import torch
from megatron.core import parallel_state

from vime_core.algo.advantages import apply_opd_kl, compute_advantages
from vime_core.algo.gates import can_reuse_log_probs_in_loss
from vime_core.algo.kl import compute_approx_kl
from vime_core.config.derive import rollout_logprob_readers
from vime_core.data.schedule import build_dp_schedule
from vime_core.data.validation import validate_trainable
from vime_core.trainer.lora import adapters_disabled
from vime_core.trainer.train_step import StepDenominators, StepInputs, forward_log_probs, train_step
from vime_core.trainer.truncation import Sampling


def advantage_column(batch: Mapping[str, Sequence[Any]]) -> Sequence[float]:
    for name in ("advantage", "reward"):
        if name in batch:
            return batch[name]
    raise ValueError(f"rollout batch has neither 'advantage' nor 'reward'; it has {sorted(batch)}")


def old_policy_log_probs(
    cfg: Any, batch: Mapping[str, Sequence[Any]], indices: Sequence[int], old: Mapping[int, torch.Tensor] | None
) -> Mapping[int, torch.Tensor]:
    """pi_old's log-probs of `indices`: the engine's when use_rollout_logprobs, else the recomputed `old`
    (as slime, where the KL penalty and the distillation signal take the rollout log-probs under
    --use-rollout-logprobs)."""
    if not cfg.use_rollout_logprobs:
        if old is None:
            raise ValueError(
                "the KL penalty (kl_coef) and distillation (use_opd) need the old log-probs, which were not recomputed"
            )
        return old
    out = {}
    for i in indices:
        log_probs = batch["rollout_log_probs"][i]
        if log_probs is None or len(log_probs) != int(batch["response_length"][i]):
            raise ValueError(
                f"use_rollout_logprobs is set but sample {i} has no rollout_log_probs "
                f"for its {batch['response_length'][i]} response tokens"
            )
        out[i] = torch.tensor([float(x) for x in log_probs], dtype=torch.float32)
    return out


def dp_sum(dp_group: Any, device: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The whitening's reducer (algo.advantages.masked_whiten): partial sums of this rank -> their
    sums over the DP group, by an all-reduce on the trainer's device (NCCL cannot reduce CPU
    tensors), back on the CPU. Every rank of the group calls it at the same points (a collective)."""

    def reduce_sums(sums: torch.Tensor) -> torch.Tensor:
        summed = sums.to(device)
        torch.distributed.all_reduce(summed, group=dp_group)
        return summed.cpu()

    return reduce_sums


def step_advantages(
    cfg: Any,
    batch: Mapping[str, Sequence[Any]],
    indices: Sequence[int],
    old: Mapping[int, torch.Tensor] | None,
    ref: Mapping[int, torch.Tensor] | None,
    values: Mapping[int, torch.Tensor] | None = None,
    teacher: Mapping[int, torch.Tensor] | None = None,
    reduce_sums: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """(advantages, returns) of `indices` (this rank's share of one step), per sample; `values`:
    the critic's V_old (ppo); `teacher`: the teacher's log-probs (use_opd); `reduce_sums`: dp_sum
    when the step is spread over DP ranks (the whitening then covers the whole step), else None."""
    scalars = advantage_column(batch)
    kl = None
    if cfg.kl_coef > 0:
        if ref is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} needs the reference log-probs")
        # On the CPU, where the advantage estimators build their tensors (old/ref live on the device).
        policy = old_policy_log_probs(cfg, batch, indices, old)
        kl = [compute_approx_kl(policy[i].cpu(), ref[i].cpu(), cfg.kl_loss_type) for i in indices]
    advantages, returns = compute_advantages(
        cfg.advantage_estimator,
        [float(scalars[i]) for i in indices],
        [batch["loss_mask"][i] for i in indices],
        kl=kl,
        values=None if values is None else [values[i] for i in indices],
        gamma=cfg.gamma,
        lambd=cfg.lambd,
        kl_coef=cfg.kl_coef,
        reduce_sums=reduce_sums,
    )
    if cfg.use_opd:
        if teacher is None:
            raise ValueError("use_opd needs the teacher's log-probs (opd_teacher_load)")
        student = old_policy_log_probs(cfg, batch, indices, old)
        advantages, _ = apply_opd_kl(
            advantages, [student[i] for i in indices], [teacher[i] for i in indices], cfg.opd_kl_coef
        )
    return dict(zip(indices, advantages)), dict(zip(indices, returns))


def trained_tokens(loss_masks: Sequence[Sequence[int]], per_step: Sequence[Mapping[str, float]], gbs: int) -> int:
    """Loss-mask-1 tokens of the policy's optimizer steps that were applied (not skipped for a
    non-finite loss or gradient): the compute ledger's `trained` (vime_core/ledger.py)."""
    return sum(
        sum(loss_masks[i])
        for step, m in enumerate(per_step)
        if not m.get("skipped_steps")
        for i in range(step * gbs, (step + 1) * gbs)
    )


def train_on_rollout(trainer: Any, batch: Mapping[str, Sequence[Any]], rollout_id: int = 0) -> dict[str, Any]:
    """Train one rollout on this rank; returns the per-step metrics averaged over the steps (lr: the
    last step's), num_steps and tokens.

        check       validate_trainable, requiring rollout_log_probs where a flag reads them
        schedule    build_dp_schedule -> this rank's micro-batches per step
        old         recomputed once before the first step, unless can_reuse_log_probs_in_loss (each step
                    then uses its own detached log-probs); skipped when use_rollout_logprobs without
                    get_mismatch_metrics
        reference   the frozen reference policy's forward when a KL term needs it (gates.needs_reference);
                    with LoRA and no ref_load, the policy's forward with its adapters off (trainer/lora.py)
        teacher     the frozen teacher's forward when use_opd (gates.needs_teacher)
        values      with a critic (ppo): V_old of all of this rank's samples, once
        advantages  per step, whitened over the whole step (dp_sum), so independent of the DP layout;
                    then apply_opd_kl when use_opd
        steps       the critic's optimizer step, then the policy's; rollout ids below
                    num_critic_only_steps train the critic only"""
    cfg, lay = trainer.cfg, trainer.layout
    # the trainability check (train_step.check_batch's), with the engines' log-probs required
    # where a flag reads them: a replayed batch stored without them stops here, naming the column
    n = validate_trainable(batch, log_prob_readers=rollout_logprob_readers(cfg))
    lengths = [len(t) for t in batch["tokens"]]
    budget = cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None
    schedule = build_dp_schedule(lengths, cfg.global_batch_size, lay.dp_size, cfg.micro_batch_size, budget)
    mine = schedule.micro_batches[lay.dp_rank]
    all_mine = [mb for step in mine for mb in step]
    # the engines' sampling (temperature, top-k, top-p): every forward scores what they sampled from
    vocab, sampling, device = trainer.arch.vocab_size, Sampling.of(cfg), trainer.device

    critic = getattr(trainer, "critic", None)  # None: an estimator without one
    train_policy = critic is None or rollout_id >= cfg.num_critic_only_steps
    # a critic-only rollout reads the policy's log-probs only for the KL penalty of the returns
    policy_forwards = train_policy or cfg.kl_coef > 0
    reuse = can_reuse_log_probs_in_loss(schedule.num_microbatches, cfg)
    need_old = (not cfg.use_rollout_logprobs or cfg.get_mismatch_metrics) and not reuse and policy_forwards
    replay = bool(cfg.use_rollout_routing_replay)  # the policy's and the reference's forwards (not the teacher's)
    old = forward_log_probs(trainer.model, batch, all_mine, vocab, sampling, device, replay) if need_old else None
    # LoRA: the reference is the policy with its adapters off (no second copy of the weights)
    ref_is_base = getattr(trainer, "ref_is_base_model", False)
    ref = None
    if (trainer.ref_model is not None or ref_is_base) and policy_forwards:
        with adapters_disabled(trainer.model) if ref_is_base else contextlib.nullcontext():
            ref_model = trainer.model if ref_is_base else trainer.ref_model
            ref = forward_log_probs(ref_model, batch, all_mine, vocab, sampling, device, replay)
    teacher = (
        forward_log_probs(trainer.teacher_model, batch, all_mine, vocab, sampling, device)
        if trainer.teacher_model is not None
        else None
    )
    values = critic.values(batch, all_mine) if critic is not None else None

    dp_group = parallel_state.get_data_parallel_group() if lay.dp_size > 1 else None
    reduce_sums = dp_sum(dp_group, device) if dp_group is not None else None
    per_step: list[dict[str, float]] = []
    gbs = cfg.global_batch_size
    for step, micro_batches in enumerate(mine):
        step_indices = list(range(step * gbs, (step + 1) * gbs))
        my_indices = [i for mb in micro_batches for i in mb]
        advantages, returns = (
            step_advantages(cfg, batch, my_indices, old, ref, values, teacher, reduce_sums)
            if cfg.loss_type == "policy_loss"
            else ({}, {})
        )
        inputs = StepInputs(
            batch=batch,
            micro_batches=micro_batches,
            denominators=StepDenominators.of(batch, step_indices),
            advantages=advantages,
            old_log_probs=old,
            ref_log_probs=ref,
            teacher_log_probs=teacher,
            step_tokens=sum(lengths[i] for i in step_indices),
        )
        step_metrics: dict[str, float] = {}
        if critic is not None:
            step_metrics.update(
                critic.train_step(batch, micro_batches, inputs.denominators, returns, values, lay.dp_size, dp_group)
            )
        if train_policy:
            step_metrics.update(
                train_step(
                    trainer.model,
                    trainer.optimizer,
                    inputs,
                    cfg,
                    vocab,
                    lay.dp_size,
                    dp_group,
                    device,
                    trainer.scheduler,
                    skips=getattr(trainer, "skips", None),  # the skipped steps in a row (trainer/nonfinite.py)
                )
            )
        per_step.append(step_metrics)
    keys = sorted({k for m in per_step for k in m})
    metrics: dict[str, Any] = {
        k: sum(m[k] for m in per_step if k in m) / sum(1 for m in per_step if k in m) for k in keys
    }
    metrics["lr"] = per_step[-1].get("lr") if per_step else None
    if critic is not None and per_step:
        metrics["critic_lr"] = per_step[-1]["critic_lr"]
    metrics["num_steps"] = len(per_step) if train_policy else 0
    metrics["num_samples"] = n
    metrics["tokens"] = sum(lengths)
    metrics["trained_tokens"] = trained_tokens(batch["loss_mask"], per_step, gbs) if train_policy else 0
    metrics["reused_log_probs"] = reuse
    return metrics
