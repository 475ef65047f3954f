"""The critic of advantage_estimator=ppo: a value model beside the policy in each trainer rank, with the
policy's parallel layout (so it sleeps with it), a zero-initialised linear value head on the final
hidden states (so the first rollout's GAE advantages are REINFORCE's), and its own optimizer step
after each of the policy's, on the clipped value loss (algo/value_loss.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from vime_core.algo.losses import aggregate_loss
from vime_core.algo.value_loss import clipped_value_loss, explained_variance_from_moments
from vime_core.config.optimizer import critic_only_steps
from vime_core.trainer.hf_convert import unwrap
from vime_core.trainer.logprobs import forward_packed, hidden_states_only
from vime_core.trainer.model import architecture_from_hf, read_hf_config
from vime_core.trainer.nonfinite import SkipCounter
from vime_core.trainer.offload import offload, onload
from vime_core.trainer.optimizer import (
    build_optimizer,
    build_scheduler,
    load_optimizer_state,
    optimizer_state,
    restore_scheduler,
)
from vime_core.trainer.packing import to_device
from vime_core.trainer.train_step import (
    _Accumulator,
    gather_per_token,
    make_micro_batch,
    split_per_sample,
    step_optimizer,
)

log = logging.getLogger(__name__)

# Token means the critic's step accumulates: the clip fraction, V_old, and the moments of the
# returns R and of D = R - V_old that the explained variance is computed from.
CRITIC_METRIC_SUMS = ("value_clipfrac", "value_mean", "ev_r", "ev_r2", "ev_d", "ev_d2")


def critic_config(cfg: Any) -> Any:
    """The configuration the critic's optimizer and schedule are built from: the run's, with
    critic_lr as lr, critic_lr_warmup_iters as the warmup (config/derive.py checked them) and the
    decay lengthened by the critic-only steps (the critic steps in those rollouts, the policy not),
    so that both schedules end together."""
    return cfg.model_copy(
        update={
            "lr": cfg.critic_lr,
            "lr_warmup_iters": cfg.critic_lr_warmup_iters,
            "lr_warmup_fraction": None,
            "lr_decay_iters": cfg.lr_decay_iters + critic_only_steps(cfg),
        }
    )


def add_value_head(gpt: Any, dtype: torch.dtype) -> torch.nn.Linear:
    """Give ``gpt`` a zero-initialised head hidden -> 1 (``gpt.value_head``) and freeze its
    untied LM head, which the critic never runs (Critic's docstring)."""
    head = torch.nn.Linear(gpt.config.hidden_size, 1, bias=True, dtype=dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    gpt.value_head = head
    if not gpt.share_embeddings_and_output_weights:
        gpt.output_layer.requires_grad_(False)
    return head


def forward_values(model: Any, packed: Any) -> torch.Tensor:
    """V_t of every response token of a packed micro-batch, flat over its samples, float32."""
    gpt = unwrap(model)
    with hidden_states_only(gpt):
        hidden = forward_packed(model, packed)  # [T, 1, hidden]
    rows = hidden[:, 0].index_select(0, packed.logit_index)
    return gpt.value_head(rows).squeeze(-1).float()


class Critic:
    """The value model of one trainer rank: body + head (DDP-wrapped), its optimizer and schedule.

    V_t = w . h_t + b, h_t the body's final hidden state at the position whose logits predict response
    token t. V_old is a no-grad forward before any update: GAE's values and the value clip's centre. A
    step aggregates the value loss like the policy loss (loss_agg_mode) and steps its own Megatron Adam
    at critic_lr; a non-finite step is skipped like the policy's, counted in critic_skipped_steps.
    Without sequence parallelism every TP rank holds the same hidden states, so the head is replicated
    (Megatron's grad norm counts it once). The LM head never runs: an untied one is frozen; a tied one
    is the input embedding, which trains."""

    def __init__(self, cfg: Any, model: Any, optimizer: Any, scheduler: Any, device: Any) -> None:
        self.cfg, self.model, self.optimizer, self.scheduler, self.device = cfg, model, optimizer, scheduler, device
        self.skips = SkipCounter(cfg.max_skipped_steps, whose="critic")  # its own, the policy's rule (nonfinite.py)
        self._offloaded: list[Any] = []
        self._asleep = False

    @classmethod
    def build(
        cls,
        cfg: Any,
        policy_arch: Any,
        policy_checkpoint: Any,
        load_body: Callable[[Any, Any], Any],
        wrap_ddp: Callable[[Any], Any],
        dtype: torch.dtype,
        device: Any,
    ) -> "Critic":
        """From critic_load, else the policy's HF folder ``policy_checkpoint``. ``load_body(arch,
        checkpoint)``: the trainer's GPTModel of this rank loaded from an HF folder;
        ``wrap_ddp``: the trainer's DDP wrapper."""
        source = cfg.critic_load or policy_checkpoint
        arch = _critic_arch(cfg.critic_load, policy_arch) if cfg.critic_load else policy_arch
        body = load_body(arch, source)
        add_value_head(body, dtype)
        model = wrap_ddp(body.to(device))
        own = critic_config(cfg)
        optimizer = build_optimizer(own, model, dtype)
        log.info("critic ready from %s (lr %g)", source, own.lr)
        return cls(own, model, optimizer, build_scheduler(own, optimizer), device)

    # ---- values and the update -------------------------------------------------------------------

    @torch.no_grad()
    def values(
        self, batch: Mapping[str, Sequence[Any]], micro_batches: Sequence[Sequence[int]]
    ) -> dict[int, torch.Tensor]:
        """V_old of every sample of ``micro_batches``, per sample on the CPU (where GAE runs)."""
        out: dict[int, torch.Tensor] = {}
        for indices in micro_batches:
            mb = make_micro_batch(batch, indices, self.device)
            out.update(split_per_sample(forward_values(self.model, mb.packed).cpu(), mb.indices, mb.response_lengths))
        return out

    def train_step(
        self,
        batch: Mapping[str, Sequence[Any]],
        micro_batches: Sequence[Sequence[int]],
        denominators: Any,
        returns: Mapping[int, torch.Tensor],
        old_values: Mapping[int, torch.Tensor],
        dp_size: int,
        dp_group: Any,
    ) -> dict[str, float]:
        """One optimizer step of the value loss over this rank's micro-batches of the step (the
        policy's train_step, with the value loss): returns the critic's metrics."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        acc = _Accumulator(keys=CRITIC_METRIC_SUMS)
        for indices in micro_batches:
            mb = make_micro_batch(batch, indices, self.device)
            loss = self._micro_batch_loss(mb, denominators, returns, old_values, acc)
            (loss * dp_size).backward()  # DDP averages over DP: the step's loss is layout-free
        grad_norm, lr = step_optimizer(
            self.model, self.optimizer, self.scheduler, self.cfg, acc.loss, self.device, self.skips
        )
        sums = acc.all_reduced(dp_group, dp_size, self.device)
        metrics = {"value_loss": sums["loss"], "critic_lr": lr, "critic_skipped_steps": float(grad_norm is None)}
        if grad_norm is not None:  # None: a non-finite step, skipped
            metrics["critic_grad_norm"] = grad_norm
        for name in ("value_clipfrac", "value_mean"):
            if name in sums:
                metrics[name] = sums[name]
        if "ev_r" in sums:
            ev = explained_variance_from_moments(sums["ev_r"], sums["ev_r2"], sums["ev_d"], sums["ev_d2"])
            if ev is not None:
                metrics["explained_variance"] = ev
        return metrics

    def _micro_batch_loss(
        self,
        mb: Any,
        denominators: Any,
        returns: Mapping[int, torch.Tensor],
        old_values: Mapping[int, torch.Tensor],
        acc: Any,
    ) -> torch.Tensor:
        values = forward_values(self.model, mb.packed)
        target = to_device(gather_per_token(returns, mb.indices), values.device)
        old = to_device(gather_per_token(old_values, mb.indices), values.device)
        per_token, clipfrac = clipped_value_loss(values, old, target, self.cfg.value_clip)
        mask, count = mb.loss_mask, sum(mb.mask_counts)
        diff = target - old
        for name, per in (
            ("value_clipfrac", clipfrac),
            ("value_mean", old),
            ("ev_r", target),
            ("ev_r2", target * target),
            ("ev_d", diff),
            ("ev_d2", diff * diff),
        ):
            acc.add(name, per, mask, count)
        loss = aggregate_loss(per_token, mask, self.cfg.loss_agg_mode, mb.response_lengths, self.cfg.loss_scale_factor)
        share = denominators.share(self.cfg.loss_agg_mode, mb)
        acc.loss = acc.loss + loss.detach().double() * share
        return loss * share

    # ---- checkpoint ------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """What a rank's critic file keeps: weights (body and head), optimizer, schedule."""
        return {"model": self.model.state_dict(), **optimizer_state(self.optimizer, self.scheduler)}

    def load_state(self, state: Mapping[str, Any], where: str) -> None:
        self.model.load_state_dict(state["model"], strict=True)
        load_optimizer_state(self.optimizer, dict(state), where)
        self.scheduler = build_scheduler(self.cfg, self.optimizer)
        restore_scheduler(self.scheduler, state.get("scheduler"), 0, where)

    # ---- memory between phases (offload_train) ------------------------------------------------------

    def sleep(self) -> int:
        """Weights, optimizer state and gradient buffers to the host (nothing reads the critic
        until the next train); bytes freed (0 on CPU)."""
        if self.device.type != "cuda" or self._asleep:
            return 0
        freed, self._offloaded = offload(self.model, self.optimizer)
        self._asleep = True
        return freed

    def wake(self) -> int:
        if not self._asleep:
            return 0
        allocated = onload(self.model, self._offloaded)
        self._offloaded, self._asleep = [], False
        return allocated


def _critic_arch(path: str, policy_arch: Any) -> Any:
    """The architecture of critic_load, which must read the policy's token ids."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"critic_load={path!r}: no HF checkpoint there (config.json missing)")
    arch = architecture_from_hf(read_hf_config(path))
    if arch.vocab_size != policy_arch.vocab_size:
        raise ValueError(
            f"critic_load={path!r} has vocab_size={arch.vocab_size}, hf_checkpoint "
            f"{policy_arch.vocab_size}: the critic reads the policy's token ids"
        )
    return arch
