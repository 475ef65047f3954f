"""Routing replay on the trainer: a model's MoE layers route each token to given experts.

Megatron-core's ``RouterReplay`` (built into each ``TopKRouter`` when ``moe_enable_routing_replay``
is on) replaces the router's top-k selection; the probabilities stay live: under REPLAY_FORWARD a
router with logits z and given experts e_1..e_k weighs expert e_j by softmax(z_{e_1}, ..., z_{e_k})_j
(``norm_topk_prob``; without it softmax over all experts, then gathered), so the router still gets
gradients. Megatron's static list of replay instances holds the routers of every model built in the
process (policy, reference, critic, teacher); this module addresses one model's own routers."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from vime_core.data import routed_experts


def routers(model: torch.nn.Module) -> list[TopKRouter]:
    """``model``'s own top-k routers in layer order (DDP/Float16Module wrappers included)."""
    found = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return sorted(found, key=lambda r: r.layer_number)


def _replay_routers(model: torch.nn.Module) -> list[TopKRouter]:
    found = routers(model)
    if not found:
        raise ValueError("routing replay: the model has no MoE router (a dense model routes nothing)")
    if any(r.router_replay is None for r in found):
        raise ValueError(
            "routing replay: the model was built without moe_enable_routing_replay (use_rollout_routing_replay=false)"
        )
    return found


def checked_experts(experts: torch.Tensor, found: list[TopKRouter]) -> torch.Tensor:
    """``experts`` as int64, refused unless integer [tokens, len(found), top_k] with k distinct ids in
    [0, E) per row (checked where it lies: the host, for the engine's bytes)."""
    layers, top_k, num_experts = len(found), found[0].topk, found[0].config.num_moe_experts
    if experts.is_floating_point() or experts.is_complex() or experts.dtype == torch.bool:
        raise ValueError(f"routing replay: experts has dtype {experts.dtype}, expected an integer dtype")
    experts = experts.to(torch.int64)  # the engine sends uint8/uint16, which few torch ops take
    if experts.dim() != 3 or tuple(experts.shape[1:]) != (layers, top_k):
        raise ValueError(
            f"routing replay: experts has shape {tuple(experts.shape)}, expected [tokens, {layers} MoE layers, "
            f"top_k={top_k}]"
        )
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(
            f"routing replay: expert ids span [{int(experts.min())}, {int(experts.max())}], "
            f"the model has {num_experts} experts"
        )
    if top_k > 1 and experts.numel() and (experts.sort(-1).values.diff(dim=-1) == 0).any():
        raise ValueError(f"routing replay: a token names the same expert twice among its top_k={top_k}")
    return experts


def _token_count_check(rows: int) -> Any:
    """A router forward pre-hook that refuses a micro-batch of another length than the experts'."""

    def hook(router: TopKRouter, args: tuple) -> None:
        tokens = args[0].shape[0] * args[0].shape[1]  # [s, b, h]: Megatron routes s*b rows
        if tokens != rows:
            raise ValueError(
                f"routing replay: layer {router.layer_number} routes {tokens} tokens, experts has {rows} rows"
            )

    return hook


class ExpertAgreement:
    """How often the trainer's routers, left to themselves, would pick the experts replay gives them:

        A = sum_{t in R, l} |own_k(t, l) ∩ engine_k(t, l)| / (k * |R| * layers)

    over the rows R the engine recorded (the filler rows of ``sample_experts`` excluded), own_k the
    top-k Megatron's routing would have taken from the same scores (its own top-k function: group
    limits and expert bias included). 1 means replay changed no expert choice; 1 - A is the share
    of choices it overrode. Counted on the device, once per layer per micro-batch (activation
    recompute runs a router twice)."""

    def __init__(self, recorded: torch.Tensor, recorded_count: int) -> None:
        self.recorded = recorded  # bool [rows], on the routers' device
        self.recorded_count = recorded_count  # its sum, known on the host
        self.matched: Any = 0
        self.slots = 0
        self._counted: set[int] = set()

    def count(self, layer: int, own: torch.Tensor, replayed: torch.Tensor) -> None:
        if layer in self._counted:
            return
        self._counted.add(layer)
        same = (own.unsqueeze(-1) == replayed.unsqueeze(-2)).any(-1)  # [rows, k]: own expert j is replayed
        self.matched = self.matched + (same & self.recorded.unsqueeze(-1)).sum()
        self.slots += self.recorded_count * replayed.shape[-1]


def _counting_topk(replay: Any, layer: int, agreement: ExpertAgreement) -> Any:
    """``replay.get_replay_topk`` that also counts ``agreement`` from the router's own top-k."""
    replayed_topk = replay.get_replay_topk

    def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        probs, top = replayed_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if default_compute_topk is not None:
            with torch.no_grad():
                _, own = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
            agreement.count(layer, own, top)
        return probs, top

    return get_replay_topk


@contextmanager
def replaying(
    model: torch.nn.Module, experts: torch.Tensor, agreement: Optional[ExpertAgreement] = None
) -> Iterator[None]:
    """Inside: each MoE layer l of ``model`` routes packed token t to ``experts[t, l]`` (the packed
    order of one micro-batch: row t = token t of ``input_ids[0]``). Kept through the backward
    (activation recompute reads the same targets); cleared on exit, an exception included.
    ``agreement``: counts how often the routers' own top-k matches ``experts`` (ExpertAgreement)."""
    found = _replay_routers(model)
    targets = checked_experts(experts, found).to(next(model.parameters()).device)
    hooks = []
    try:
        for layer, router in enumerate(found):
            router.router_replay.set_target_indices(targets[:, layer].contiguous())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            hooks.append(router.register_forward_pre_hook(_token_count_check(targets.shape[0])))
            if agreement is not None:  # an instance attribute over the class's method, deleted on exit
                router.router_replay.get_replay_topk = _counting_topk(router.router_replay, layer, agreement)
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for router in found:
            router.router_replay.__dict__.pop("get_replay_topk", None)
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


class RoutingRecord:
    """What a model's routers chose in the latest forward inside ``recording`` (kept after it)."""

    def __init__(self, found: list[TopKRouter]) -> None:
        self._routers: list[TopKRouter] | None = found
        self._kept: list[torch.Tensor | None] = []

    def experts(self) -> torch.Tensor:
        """int64 [tokens, MoE layers, top_k]: layer l's top-k expert ids of packed token t."""
        chosen = self._chosen() if self._routers is not None else self._kept
        missing = [layer for layer, idx in enumerate(chosen) if idx is None]
        if missing:
            raise ValueError(f"routing replay: MoE layers {missing} recorded nothing (no forward inside recording)")
        return torch.stack([idx.detach() for idx in chosen], dim=1).to(torch.int64)

    def _chosen(self) -> list[torch.Tensor | None]:
        return [r.router_replay.get_recorded_indices() for r in self._routers]

    def _close(self) -> None:
        self._kept, self._routers = self._chosen(), None


@contextmanager
def recording(model: torch.nn.Module) -> Iterator[RoutingRecord]:
    """Inside: ``model`` routes by itself and each router keeps its top-k choice of the latest forward."""
    found = _replay_routers(model)
    for router in found:
        router.router_replay.clear_indices()
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    record = RoutingRecord(found)
    try:
        yield record
    finally:
        record._close()
        for router in found:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def engine_layers(model: torch.nn.Module) -> tuple[list[int], int]:
    """The engine's layer index of each of ``model``'s routers (Megatron's 1-based layer_number - 1;
    the engine returns every hidden layer) and their top_k."""
    found = _replay_routers(model)
    return [r.layer_number - 1 for r in found], found[0].topk


def sample_experts(
    data: Optional[bytes], layers: list[int], top_k: int, tokens: int, needed: int, where: str
) -> tuple[np.ndarray, int]:
    """One sample's experts [tokens, len(layers), top_k] (numpy, the engine's dtype) from its stored
    rows, and how many leading rows the engine recorded: the rows past those get experts
    0..top_k-1 (their outputs feed no trained log-prob: the sample's trained tokens need only the
    first ``needed`` rows, which are refused missing)."""
    if data is None:
        raise ValueError(
            f"use_rollout_routing_replay=true: {where} has no routed_experts (generated without the flag, or "
            "stored before schema version 2)"
        )
    rows = routed_experts.decode(data)
    if rows.shape[2] != top_k or rows.shape[1] <= max(layers):
        raise ValueError(
            f"use_rollout_routing_replay=true: {where}'s routed_experts have {rows.shape[1]} layers x "
            f"top_{rows.shape[2]}, the model routes layers {layers[0]}..{layers[-1]} with top_k={top_k}"
        )
    if rows.shape[0] < needed:
        raise ValueError(
            f"use_rollout_routing_replay=true: {where} has routed_experts for {rows.shape[0]} tokens, its trained "
            f"tokens need {needed}"
        )
    out = np.empty((tokens, len(layers), top_k), dtype=rows.dtype)
    out[:] = np.arange(top_k, dtype=rows.dtype)
    kept = min(rows.shape[0], tokens)
    out[:kept] = rows[:kept][:, layers]
    return out, kept


@dataclass
class PackedRouting:
    """A micro-batch's experts for ``replaying`` (int64 [rows, MoE layers, top_k]) and which rows
    the engine recorded (bool [rows]; the others are ``sample_experts``' filler)."""

    experts: torch.Tensor
    recorded: torch.Tensor

    def agreement(self, device: Any) -> ExpertAgreement:
        return ExpertAgreement(self.recorded.to(device), int(self.recorded.sum()))


def packed_routing(batch: Mapping[str, Sequence[Any]], indices: Sequence[int], model: torch.nn.Module) -> PackedRouting:
    """The experts of a micro-batch of ``indices`` in pack_samples' order (sample i's tokens at
    [cu_i, cu_i + L_i)), with the rows the engine recorded."""
    layers, top_k = engine_layers(model)
    column = batch.get("routed_experts") or [None] * len(batch["tokens"])
    parts, recorded = [], []
    for i in indices:
        tokens, response = len(batch["tokens"][i]), int(batch["response_length"][i])
        trained = [j for j, m in enumerate(batch["loss_mask"][i]) if m]
        needed = tokens - response + trained[-1] if trained else 0  # the last trained token's position
        experts, kept = sample_experts(column[i], layers, top_k, tokens, needed, f"sample {i}")
        parts.append(experts)
        recorded.append(np.arange(tokens) < kept)
    return PackedRouting(
        torch.from_numpy(np.concatenate(parts)).to(torch.int64), torch.from_numpy(np.concatenate(recorded))
    )


def replay_of(
    model: torch.nn.Module, experts: Optional[torch.Tensor], agreement: Optional[ExpertAgreement] = None
) -> Any:
    """``replaying(model, experts, agreement)``, or nothing when ``experts`` is None (replay off)."""
    return nullcontext() if experts is None else replaying(model, experts, agreement)
