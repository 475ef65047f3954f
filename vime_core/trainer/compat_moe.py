"""megatron-core's MoE layer as vime runs it: without Transformer Engine (absent on the CPU box and
the GPU host), with TP ranks that each hold the whole sequence (no sequence parallelism) and, with
expert parallelism, EP ranks whose micro-batches hold different numbers of tokens."""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher


def define_missing_te_gemm() -> bool:
    """Set ``moe_utils.te_general_gemm`` to None when TE left it undefined (idempotent); whether it did.

    megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` from TE inside a try block and
    the router's gating GEMM (``RouterGatingLinearFunction``) tests ``te_general_gemm is not None``
    unguarded: without TE every MoE forward raises NameError. None selects the ``torch.mm`` path
    megatron-core already has (its other TE kernels are guarded by ``HAVE_TE``)."""
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True


class _OneRank:
    """Stands in for the attention TP group of a ``MoELayer``, read only by its sequence-parallel check."""

    def size(self) -> int:
        return 1


def allow_full_sequence_tp(model: Any) -> int:
    """Let ``model``'s MoE layers train at TP > 1 without sequence parallelism; how many layers.

    Megatron refuses that combination in training (``MoELayer.forward``) because its MoE layer
    expects each TP rank to hold a different part of the sequence. Here each TP rank holds all of it:
    the allgather dispatcher gathers the TP ranks' identical copies, every rank's experts compute
    their TP slice of all copies and the reduce-scatter hands each rank the complete output of its
    own copy. Outputs, the router's and the activations' gradients are then those of TP=1, and each
    expert weight's gradient is TP times its TP=1 value (it sums over TP identical copies of every
    token): a gradient hook divides it by TP. The cost is TP times the expert FLOPs of a
    sequence-parallel run. ``attn_tp_group`` serves only that check in megatron-core 0.16.1 (the
    dispatcher and the experts keep their own groups), so a one-rank stand-in lifts it.

    The router's losses sum its tokens-per-expert over ``tp_cp_group`` (and divide the z-loss by its
    size), counting each token TP times here: the same stand-in keeps them at their TP=1 values, as
    the router's gradient is (the tracker's reduction over that group, which vime does not call, is
    the only other use)."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    for layer in layers:
        copies = layer.attn_tp_group.size()
        layer.attn_tp_group = _OneRank()
        layer.router.tp_cp_group = _OneRank()
        if copies > 1:
            for param in layer.experts.parameters():
                param.register_hook(functools.partial(torch.div, other=copies))
    return len(layers)


class PaddedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """The allgather dispatcher for token counts that differ over its TP x EP group.

    Megatron's gathers the group's tokens with an equal-size all-gather, as its sequence-parallel
    TP ranks hold equal parts of one sequence. EP ranks are data-parallel ranks holding different
    packed micro-batches, so each rank pads its tokens to the group's largest count (one scalar
    all-reduce) with rows routed to no expert (routing-map row false, probabilities 0): no expert
    sees them, their outputs are 0 and they are cut after the reduce-scatter, so the real tokens'
    outputs and gradients are those of the unpadded run. (gloo has no all-gather of unequal parts.)"""

    def dispatch_preprocess(
        self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, self.hidden_shape[-1])
        self.real_tokens = hidden.shape[0]
        most = torch.tensor([self.real_tokens], dtype=torch.int64, device=hidden.device)
        torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX, group=self.tp_ep_group)
        pad = int(most.item()) - self.real_tokens
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
            routing_map = torch.cat([routing_map, routing_map.new_zeros(pad, routing_map.shape[1])])
        self.routing_map = routing_map
        return hidden, probs

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[: self.real_tokens].view(self.hidden_shape)


def pad_tokens_over_ep(model: Any) -> int:
    """Give ``model``'s MoE layers split over EP ranks the ``PaddedAllGatherDispatcher``; how many."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, MoELayer) and type(m.token_dispatcher) is MoEAllGatherTokenDispatcher
        if m.token_dispatcher.ep_size > 1
    ]
    for layer in layers:
        layer.token_dispatcher.__class__ = PaddedAllGatherDispatcher  # same state, two methods differ
    return len(layers)
