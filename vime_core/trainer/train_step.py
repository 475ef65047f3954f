"""One training step over this DP rank's micro-batches B_1..B_M of the step's samples S (all DP ranks):

    L(B_m) = agg(pg * w) + [use_kl_loss] kl_loss_coef * agg(kl(log p, log p_ref)) - entropy_coef * agg(H)
             + [MoE] sum_layers (moe_aux_loss_coeff * lb_l(B_m) + moe_z_loss_coeff * z_l(B_m))
    backward( L(B_m) * d(B_m) / D(S) * dp_size )          (DDP averages gradients over DP)

pg is the estimator's registered policy loss (or -log p for sft_loss), w the rollout importance
weight when use_tis, agg = aggregate_loss(., loss_mask, loss_agg_mode), and D the step-wide
denominator (tokens or sequences, by loss_agg_mode), so the loss does not depend on the TP/DP
layout or the micro-batch split. Then one optimizer step, skipped on every rank when the loss or a
gradient is not finite on any (vime_core/trainer/nonfinite.py). The router's terms lb_l and z_l
enter through Megatron's router, their weight set by vime_core/trainer/router_losses.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from vime_core.algo import get_policy_loss_fn
from vime_core.algo.kl import compute_approx_kl
from vime_core.algo.losses import PolicyLossParams, aggregate_loss, policy_loss_name, rollout_is_weights
from vime_core.data.validation import validate_trainable
from vime_core.trainer.logprobs import packed_response_log_probs
from vime_core.trainer.nonfinite import SkipCounter, step_is_finite
from vime_core.trainer.optimizer import current_lr
from vime_core.trainer.packing import PackedMicroBatch, pack_samples, to_device
from vime_core.trainer.routing_replay import ExpertAgreement, PackedRouting, packed_routing, replay_of
from vime_core.trainer.router_losses import router_loss_metrics, set_router_loss_weight, take_router_losses
from vime_core.trainer.truncation import Sampling
from vime_core.utils.timing import timed

log = logging.getLogger(__name__)

# tis_weight: mean w_t over the loss tokens; tis_rejected_frac: the share of them tis_mode=mask rejected
# opd_reverse_kl: mean of log pi_old - log pi_teacher over the loss tokens (use_opd)
# train_rollout_k3_kl: KL(engine || trainer) over the loss tokens, Schulman's k3 of the engine's
# sampled tokens: exp(r) - 1 - r, r = log p_trainer - log p_engine (vime_core/algo/kl.py)
METRIC_SUMS = (
    "pg_clipfrac",
    "kl",
    "entropy",
    "train_rollout_logprob_abs_diff",
    "train_rollout_k3_kl",
    "tis_weight",
    "tis_rejected_frac",
    "opd_reverse_kl",
)
# routing replay: the share of the engine's experts the trainer's routers would have chosen themselves,
# over every MoE layer and recorded token of the step (routing_replay.ExpertAgreement)
EXPERT_AGREEMENT = "routing_replay_expert_agreement"


def check_batch(batch: Mapping[str, Sequence[Any]]) -> int:
    """Number of samples; raises naming the column and row that the trainer cannot train on
    (the one check the rollout side applies too: vime_core/data/validation.py)."""
    return validate_trainable(batch)


@dataclass
class MicroBatch:
    """Model inputs and per-token columns of one micro-batch (flat over response tokens)."""

    indices: list[int]
    packed: PackedMicroBatch
    loss_mask: torch.Tensor
    rollout_log_probs: Optional[torch.Tensor]
    mask_counts: list[float]  # sum of loss_mask per sample, from the host lists
    routing: Optional[PackedRouting] = None  # routing replay: the engine's experts per packed token

    @property
    def response_lengths(self) -> list[int]:
        return self.packed.response_lengths

    @property
    def experts(self) -> Optional[torch.Tensor]:
        return self.routing.experts if self.routing is not None else None

    def expert_agreement(self, device: Any) -> Optional[ExpertAgreement]:
        """Routing replay: a count of the routers' own choices against the engine's (None: off)."""
        return self.routing.agreement(device) if self.routing is not None else None


def make_micro_batch(
    batch: Mapping[str, Sequence[Any]], indices: Sequence[int], device: Any, replay_model: Any = None
) -> MicroBatch:
    """``replay_model``: routing replay, the model whose routers take the engine's experts (None: off)."""
    responses = [int(batch["response_length"][i]) for i in indices]
    packed = pack_samples([batch["tokens"][i] for i in indices], responses, device=device)
    masks = [[float(m) for m in batch["loss_mask"][i]] for i in indices]
    mask = to_device(torch.tensor([m for sample in masks for m in sample], dtype=torch.float32), device)
    rollout = batch.get("rollout_log_probs")
    has_rollout = rollout is not None and all(
        rollout[i] is not None and len(rollout[i]) == r for i, r in zip(indices, responses)
    )
    rollout_lp = (
        to_device(torch.tensor([float(x) for i in indices for x in rollout[i]], dtype=torch.float32), device)
        if has_rollout
        else None
    )
    routing = packed_routing(batch, indices, replay_model) if replay_model is not None else None
    return MicroBatch(list(indices), packed, mask, rollout_lp, [sum(sample) for sample in masks], routing)


def split_per_sample(flat: torch.Tensor, indices: Sequence[int], lengths: Sequence[int]) -> dict[int, torch.Tensor]:
    return dict(zip(indices, torch.split(flat, list(lengths))))


def gather_per_token(values: Mapping[int, torch.Tensor], indices: Sequence[int]) -> torch.Tensor:
    return torch.cat([values[i] for i in indices])


@torch.no_grad()
def forward_log_probs(
    model: torch.nn.Module,
    batch: Mapping[str, Sequence[Any]],
    micro_batches: Sequence[Sequence[int]],
    vocab_size: int,
    sampling: float | Sampling,
    device: Any,
    replay: bool = False,
) -> dict[int, torch.Tensor]:
    """Response-token log-probs of every sample in ``micro_batches`` under the current weights,
    at the rollout's ``Sampling`` (or a bare temperature); ``replay``: routed as the engines did."""
    out: dict[int, torch.Tensor] = {}
    for indices in micro_batches:
        mb = make_micro_batch(batch, indices, device, model if replay else None)
        with replay_of(model, mb.experts):
            lp, _ = packed_response_log_probs(model, mb.packed, vocab_size, sampling)
        out.update(split_per_sample(lp.float(), mb.indices, mb.response_lengths))
    return out


@dataclass(frozen=True)
class StepDenominators:
    """Step-wide denominators of the loss aggregation (over every DP rank's samples)."""

    tokens: float
    valid_sequences: float
    sequences: float

    @classmethod
    def of(cls, batch: Mapping[str, Sequence[Any]], step_indices: Sequence[int]) -> "StepDenominators":
        masks = [sum(float(m) for m in batch["loss_mask"][i]) for i in step_indices]
        return cls(sum(masks), float(sum(1 for m in masks if m > 0)), float(len(masks)))

    def share(self, mode: str, mb: MicroBatch) -> float:
        """d(B) / D(S): the micro-batch's weight in the step's mean (host-side counts: no sync)."""
        if mode == "token_mean":
            return sum(mb.mask_counts) / max(self.tokens, 1.0)
        if mode == "seq_mean_token_mean":
            return sum(1 for c in mb.mask_counts if c > 0) / max(self.valid_sequences, 1.0)
        return len(mb.mask_counts) / max(self.sequences, 1.0)


@dataclass
class StepInputs:
    """Everything about the data of one step on this rank, besides the model."""

    batch: Mapping[str, Sequence[Any]]
    micro_batches: Sequence[Sequence[int]]
    denominators: StepDenominators
    advantages: Mapping[int, torch.Tensor]
    old_log_probs: Optional[Mapping[int, torch.Tensor]]  # None: reuse the current ones (detached)
    ref_log_probs: Optional[Mapping[int, torch.Tensor]] = None
    teacher_log_probs: Optional[Mapping[int, torch.Tensor]] = None  # use_opd's teacher, for its metric
    step_tokens: int = 0  # prompt + response tokens of the whole step (all DP ranks)


@dataclass
class _Accumulator:
    """Metric sums as device tensors (summed without reading them back), counts on the host;
    ``keys`` the token-mean metrics (the policy's, or the critic's: trainer/critic.py)."""

    keys: tuple[str, ...] = METRIC_SUMS
    sums: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)
    loss: Any = 0.0
    pg_loss: Any = 0.0
    # step means weighted like the loss (sum_m d(B_m)/D(S) * value(B_m) over every DP rank): the router's losses
    weighted_keys: tuple[str, ...] = ()
    weighted: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sums = {k: 0.0 for k in self.keys}
        self.counts = {k: 0.0 for k in self.keys}
        self.weighted = {k: 0.0 for k in self.weighted_keys}

    def add(self, name: str, per_token: torch.Tensor, mask: torch.Tensor, count: float) -> None:
        """Add sum(per_token * mask); ``count`` = sum(mask), known on the host."""
        self.add_total(name, (per_token.detach().double() * mask).sum(), count)

    def add_total(self, name: str, total: Any, count: float) -> None:
        """Add a sum already taken (a device tensor or a number) over ``count`` items."""
        self.sums[name] = self.sums[name] + total
        self.counts[name] += count

    def all_reduced(self, dp_group: Any, dp_size: int, device: Any = "cpu") -> dict[str, float]:
        keys = list(self.keys)
        # On the trainer's device: NCCL (the GPU backend) cannot reduce CPU tensors.
        weighted = list(self.weighted_keys)
        values = [self.sums[k] for k in keys] + [self.loss, self.pg_loss] + [self.weighted[k] for k in weighted]
        t = torch.cat(
            [
                torch.stack([torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()) for v in values]),
                torch.tensor([self.counts[k] for k in keys], dtype=torch.float64).to(device),
            ]
        )
        if dp_size > 1:
            torch.distributed.all_reduce(t, group=dp_group)
        t = t.tolist()  # the step's one read-back
        n, w = len(keys), len(weighted)
        out = {k: t[i] / t[n + 2 + w + i] for i, k in enumerate(keys) if t[n + 2 + w + i] > 0}
        out["loss"], out["pg_loss"] = t[n], t[n + 1]
        out.update({k: t[n + 2 + i] for i, k in enumerate(weighted)})
        return out


def micro_batch_loss(
    model: torch.nn.Module, mb: MicroBatch, inputs: StepInputs, cfg: Any, vocab_size: int, acc: _Accumulator
) -> torch.Tensor:
    """L(B_m) of the module docstring (unweighted), recording metrics in ``acc``.

    Old log-probs are the engine's (use_rollout_logprobs), the current ones detached
    (can_reuse_log_probs_in_loss: the policy has not moved yet), or a no-grad forward beforehand. A
    token tis_mode=mask rejects (w = 0) adds nothing and still counts in agg's and D's denominators
    (as slime; verl drops it from the mean), so a rejected sample shrinks the step."""
    log_probs, entropy = packed_response_log_probs(
        model, mb.packed, vocab_size, Sampling.of(cfg), with_entropy=True, entropy_grad=cfg.entropy_coef > 0
    )
    mask, lengths = mb.loss_mask, mb.response_lengths
    count = sum(mb.mask_counts)

    def agg(per_token: torch.Tensor) -> torch.Tensor:
        return aggregate_loss(per_token, mask, cfg.loss_agg_mode, lengths, cfg.loss_scale_factor)

    # The trainer's log-probs of the sampled tokens before this rollout's updates: recomputed
    # beforehand, or (reuse) the current ones, since the policy has not moved yet.
    recomputed = (
        log_probs.detach() if inputs.old_log_probs is None else gather_per_token(inputs.old_log_probs, mb.indices)
    )
    if mb.rollout_log_probs is not None:
        acc.add("train_rollout_logprob_abs_diff", (recomputed - mb.rollout_log_probs).abs(), mask, count)
        acc.add("train_rollout_k3_kl", compute_approx_kl(mb.rollout_log_probs, recomputed, "k3", mask), mask, count)
    if cfg.use_rollout_logprobs:
        if mb.rollout_log_probs is None:
            raise ValueError("use_rollout_logprobs is set but the batch has no rollout_log_probs")
        old = mb.rollout_log_probs
    else:
        old = recomputed
    acc.add("entropy", entropy, mask, count)
    if inputs.teacher_log_probs is not None:
        teacher = to_device(gather_per_token(inputs.teacher_log_probs, mb.indices), old.device)
        acc.add("opd_reverse_kl", old - teacher, mask, count)

    if cfg.loss_type == "sft_loss":
        per_token = -log_probs
        clipfrac = torch.zeros_like(log_probs)
    else:
        # Advantages are computed on the CPU (small per-sample math); the loss runs on the model's device.
        advantages = to_device(gather_per_token(inputs.advantages, mb.indices), log_probs.device)
        loss_fn = get_policy_loss_fn(policy_loss_name(cfg.advantage_estimator))
        per_token, clipfrac = loss_fn(log_probs, old, advantages, mask, lengths, PolicyLossParams.from_config(cfg))
        if cfg.use_tis:
            if mb.rollout_log_probs is None:
                raise ValueError("use_tis is set but the batch has no rollout_log_probs")
            weights = rollout_is_weights(
                old, mb.rollout_log_probs, mask, lengths, cfg.tis_level, cfg.tis_mode, cfg.tis_clip, cfg.tis_clip_low
            )
            per_token = per_token * weights
            acc.add("tis_weight", weights, mask, count)
            if cfg.tis_mode == "mask":  # every kept weight is >= exp(-20) > 0: 0 means rejected
                acc.add("tis_rejected_frac", (weights == 0).float(), mask, count)
    acc.add("pg_clipfrac", clipfrac, mask, count)
    pg_loss = agg(per_token)
    loss = pg_loss
    if cfg.use_kl_loss:
        if inputs.ref_log_probs is None:
            raise ValueError("use_kl_loss needs reference log-probs")
        # masked: a token the loss leaves out gets a KL of exactly 0 and no gradient (algo/kl.py)
        kl = compute_approx_kl(log_probs, gather_per_token(inputs.ref_log_probs, mb.indices), cfg.kl_loss_type, mask)
        acc.add("kl", kl, mask, count)
        loss = loss + cfg.kl_loss_coef * agg(kl)
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * agg(entropy)
    share = inputs.denominators.share(cfg.loss_agg_mode, mb)
    acc.loss = acc.loss + loss.detach().double() * share
    acc.pg_loss = acc.pg_loss + pg_loss.detach().double() * share
    return loss * share


def train_step(
    model: Any,
    optimizer: Any,
    inputs: StepInputs,
    cfg: Any,
    vocab_size: int,
    dp_size: int,
    dp_group: Any,
    device: Any,
    scheduler: Any = None,
    skips: Optional[SkipCounter] = None,
) -> dict[str, float]:
    """Forward/backward over this rank's micro-batches, one optimizer step (then one step of
    Megatron's lr ``scheduler``, when given) unless the loss or a gradient is not finite on some
    rank (step_optimizer); returns the metrics, skipped_steps 1 for a skipped step (no grad_norm:
    none was applied). ``skips``: the trainer's count of skipped steps in a row.

    Gradients accumulate in Megatron's DDP buffers; finalize_model_grads all-reduces them over DP
    (and the q/k-norm grads over TP), then clipping to clip_grad. Metrics are token means over the
    step (all-reduced over DP) and stay on the device until the step ends: the micro-batch loop reads
    nothing back from the GPU, so the host keeps queueing micro-batches."""
    with timed() as step:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        replay_model = model if getattr(cfg, "use_rollout_routing_replay", False) else None
        acc = _Accumulator(
            keys=METRIC_SUMS + ((EXPERT_AGREEMENT,) if replay_model is not None else ()),
            weighted_keys=router_loss_metrics(cfg),
        )
        take_router_losses()  # drop what a forward outside this step recorded
        for indices in inputs.micro_batches:
            mb = make_micro_batch(inputs.batch, indices, device, replay_model)
            agreement = mb.expert_agreement(device)
            with replay_of(model, mb.experts, agreement):  # through the backward: recompute routes the same way
                loss = micro_batch_loss(model, mb, inputs, cfg, vocab_size, acc)
                share = inputs.denominators.share(cfg.loss_agg_mode, mb)
                set_router_loss_weight(share * dp_size)  # the router's losses weighted like L(B_m)
                (loss * dp_size).backward()
            if agreement is not None:
                acc.add_total(EXPERT_AGREEMENT, agreement.matched, agreement.slots)
            for name, value in take_router_losses().items():
                if name in acc.weighted:
                    acc.weighted[name] = acc.weighted[name] + value * share
        grad_norm, lr = step_optimizer(model, optimizer, scheduler, cfg, acc.loss, device, skips)
        metrics = acc.all_reduced(dp_group, dp_size, device)
    elapsed = step.seconds
    if grad_norm is not None:
        metrics["grad_norm"] = grad_norm
    metrics["skipped_steps"] = float(grad_norm is None)
    metrics["lr"] = lr
    metrics["step_time_s"] = elapsed
    metrics["tokens_per_s"] = inputs.step_tokens / elapsed if elapsed > 0 else 0.0
    return metrics


def step_optimizer(
    model: Any, optimizer: Any, scheduler: Any, cfg: Any, loss: Any, device: Any, skips: Optional[SkipCounter] = None
) -> tuple[Optional[float], float]:
    """After the micro-batches' backward: finalize the gradients; then, when the step's ``loss``
    and gradients are finite on every rank (vime_core/trainer/nonfinite.py), one optimizer step
    (clipped to clip_grad) at the schedule's learning rate and one step of the schedule (when
    given), else nothing moves and the gradients are zeroed. ``skips`` counts the skipped steps in a
    row and raises past max_skipped_steps (None: a count of this step alone). Returns (grad_norm,
    lr), grad_norm None for a skipped step. The policy's step and the critic's (trainer/critic.py)."""
    # Average the accumulated grads over DP, and sum over TP the grads of parameters that each
    # TP rank only sees part of (Qwen3's per-head q/k norms).
    finalize_model_grads([model])
    lr = current_lr(optimizer)
    grad_norm: Optional[float] = None
    if step_is_finite(model, loss, device):
        norm = None if cfg.clip_grad > 0 else optimizer.get_grad_norm()
        ok, clipped_norm, _ = optimizer.step()
        if ok:
            grad_norm = float(clipped_norm if clipped_norm is not None else norm)
        else:  # Megatron's own check (an fp16 grad scaler's found_inf) skipped it: nothing moved
            log.warning("Megatron's optimizer found a non-finite gradient and skipped the step")
    if grad_norm is None:
        model.zero_grad_buffer()
        optimizer.zero_grad()
    elif scheduler is not None:
        scheduler.step(increment=1)
    (skips or SkipCounter(cfg.max_skipped_steps)).record(skipped=grad_norm is None)
    return grad_norm, lr
