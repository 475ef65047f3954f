"""Per-token log-probs and entropy of response tokens over a TP-split vocabulary.

Each TP rank holds logits ``z[:, V_r]`` for its slice ``V_r`` of the padded vocabulary. With
temperature ``tau`` (the rollout's, so train log-probs match the engine's processed log-probs)
and ``y = z / tau``:

    log p(a)   = y_a - logsumexp_v y_v          (vocab_parallel_cross_entropy, negated)
    H          = logsumexp_v y_v - sum_v p_v y_v

where the logsumexp and the sums over ``v`` are all-reduced over the TP group (max with MAX, sums
with SUM through Megatron's autograd-aware ``reduce_from_tensor_model_parallel_region``, whose
backward is the identity, so each rank gets the gradient of its own slice).

Vocabulary padding rows (ids >= the real vocabulary size) are not tokens: their logits are set to
the dtype's most negative finite value first, so they get probability 0 (a finite value rather
than -inf keeps ``p * y`` at 0 instead of NaN).
"""

from __future__ import annotations

from typing import Optional

import torch


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Logits of this rank's slice with the padding ids pushed to the most negative value."""
    per_rank = logits.shape[-1]
    start = tp_rank * per_rank
    if start + per_rank <= vocab_size:
        return logits
    ids = torch.arange(start, start + per_rank, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logits`` [N, V/tp] (this rank's slice), ``targets`` [N] global ids -> (log_probs [N],
    entropy [N] or None), float32; the entropy is differentiable only when ``entropy_grad``
    (a metric-only entropy skips building its backward graph)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    y = logits.float()
    if temperature != 1.0:
        y = y / temperature
    y = mask_vocab_padding(y, vocab_size, tp_rank).contiguous()
    entropy = None
    if with_entropy:
        entropy = _vocab_parallel_entropy(y if entropy_grad else y.detach())
    # vocab_parallel_cross_entropy works in place on its input (subtracts the max, exponentiates):
    # give it a copy when the entropy's backward graph still needs y.
    log_probs = -vocab_parallel_cross_entropy(y.clone() if with_entropy and entropy_grad else y, targets)
    return log_probs, entropy


def _vocab_parallel_entropy(y: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(y) - sum p y over the TP-split last dimension (formula in the docstring)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    y_max = y.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            y_max, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    shifted = y - y_max
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    probs = exp / sum_exp.unsqueeze(-1)
    expected = reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1))
    return sum_exp.log() - expected


def packed_response_log_probs(
    model: torch.nn.Module,
    packed: "PackedMicroBatch",  # noqa: F821  (vime_core.trainer.packing)
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward a packed micro-batch and return its response tokens' log-probs (and entropy),
    flat over the samples in order (``sum(response_lengths)`` long)."""
    logits = model(
        packed.input_ids,
        packed.position_ids,
        None,  # THD packing: attention is causal inside each sample (cu_seqlens)
        packed_seq_params=packed.packed_seq_params(),
    )
    response_logits = logits[0].index_select(0, packed.logit_index)
    return log_probs_and_entropy(response_logits, packed.targets, vocab_size, temperature, with_entropy, entropy_grad)
