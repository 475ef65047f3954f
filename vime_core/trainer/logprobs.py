"""Per-token log-probs and entropy of response tokens over a TP-split vocabulary.

Each TP rank holds the output weights W[V_r] of its vocabulary slice, so its logits are z_v = x . W_v.
With y = z / tau (tau: the rollout's temperature, so train log-probs match the engine's):

    lse = logsumexp_v y_v,   log p(a) = y_a - lse,   H = lse - sum_v p_v y_v   (p_v = exp(y_v - lse))

the sums over v reduced over the TP group; vocabulary padding gets probability 0 and no gradient.
With top-k / top-p every sum is weighted by the kept set's w_v (vime_core/trainer/truncation.py).
`packed_response_log_probs` (the trainer's) computes logits only at the response positions, chunk
by chunk (`ResponseHead`), so the fp32 [rows x vocab] tensor never exists in full;
`packed_response_log_probs_full` is the straightforward full head the tests compare it with."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from vime_core.trainer.compiled import run_compiled
from vime_core.trainer.hf_convert import unwrap
from vime_core.trainer.truncation import (
    Collectives,
    ProcessGroupCollectives,
    Sampling,
    as_sampling,
    keep_weights,
    select,
)

# Logits per chunk (rows x vocabulary columns): 512 Mi elements, 1 GiB in bf16, so a chunk is a
# few thousand rows of the 152k vocabulary, large enough for efficient matmuls and few launches.
CHUNK_ELEMENTS = 1 << 29
# torch.compile of the chunk math on CUDA (ResponseHead); the benchmark switches it off to
# measure the eager functions.
COMPILE_ON_CUDA = True
# With top-k / top-p a chunk holds a quarter of the rows: the selection keeps a few more
# [rows x vocabulary] tensors alive (the weights, a top-m's values and indices).
TRUNCATED_CHUNK_DIVISOR = 4


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Logits of this rank's slice with the padding ids pushed to -sqrt(dtype max): exp gives 0,
    and unlike -inf (or the dtype's min) its products with logit-sized numbers stay finite, so
    ``p * y`` is 0 in the entropy and its gradient is not NaN."""
    per_rank = logits.shape[-1]
    start = tp_rank * per_rank
    if start + per_rank <= vocab_size:
        return logits
    ids = torch.arange(start, start + per_rank, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, -(torch.finfo(logits.dtype).max ** 0.5))


# ---- the straightforward head: full logits ----------------------------------------------------------


def log_probs_and_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    sampling: float | Sampling = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``logits`` [N, V/tp] (this rank's slice), ``targets`` [N] global ids -> (log_probs [N],
    entropy [N] or None), float32; the entropy is differentiable only when ``entropy_grad``
    (a metric-only entropy skips building its backward graph). ``sampling``: the temperature, or
    the whole ``Sampling`` (with top-k / top-p: over the kept set: truncation.py)."""
    sampling = as_sampling(sampling)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    y = logits.float()
    if sampling.temperature != 1.0:
        y = y / sampling.temperature
    y = mask_vocab_padding(y, vocab_size, tp_rank).contiguous()
    weights = _full_head_weights(y, targets, vocab_size, sampling, tp_rank) if sampling.truncates(vocab_size) else None
    entropy = None
    if with_entropy:
        entropy = _vocab_parallel_entropy(y if entropy_grad else y.detach(), weights)
    scored = y
    if weights is not None:  # log sum_v w_v e^{y_v}: outside S -inf-like (padding's value), a tie's share as log w
        scored = torch.where(weights > 0, y + weights.log(), -(torch.finfo(y.dtype).max ** 0.5))
    # vocab_parallel_cross_entropy works in place on its input (subtracts the max, exponentiates):
    # give it a copy when the entropy's backward graph still needs y.
    copy = scored is y and with_entropy and entropy_grad
    log_probs = -vocab_parallel_cross_entropy(scored.clone() if copy else scored, targets)
    return log_probs, entropy


def _full_head_weights(
    y: torch.Tensor, targets: torch.Tensor, vocab_size: int, sampling: Sampling, tp_rank: int
) -> torch.Tensor:
    """w_v of the kept set over this rank's [N, V/tp] slice (padding 0)."""
    per_rank = y.shape[-1]
    start = tp_rank * per_rank
    valid = max(0, min(per_rank, vocab_size - start))
    local = targets - start
    comm = _tp_collectives(parallel_state)
    tau, w_tie = select(y.detach()[:, :valid], local, sampling, vocab_size, per_rank, comm)
    hit = torch.arange(per_rank, device=y.device).unsqueeze(0) == local.unsqueeze(1)
    return keep_weights(y.detach(), hit, tau, w_tie)


def _tp_collectives(parallel_state: Any) -> Optional[Collectives]:
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return ProcessGroupCollectives(parallel_state.get_tensor_model_parallel_group())


def _vocab_parallel_entropy(y: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """H = logsumexp(y) - sum p y over the TP-split last dimension (formula in the docstring);
    with ``weights`` w, over the kept set: every sum's terms weighted by w."""
    y_max = y.detach().max(dim=-1, keepdim=True).values
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(
            y_max, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
        )
    shifted = y - y_max
    exp = shifted.exp()
    if weights is not None:
        exp = exp * weights
    # Both sums reduced before they meet (H = log s - t / s): a reduction's backward is the
    # identity, right only for a gradient that every rank computes whole. (Dividing by the
    # reduced s before the second reduction lost the other ranks' share of d/ds at TP > 1.)
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    weighted = reduce_from_tensor_model_parallel_region((exp * shifted).sum(dim=-1))
    return sum_exp.log() - weighted / sum_exp


def packed_response_log_probs_full(
    model: torch.nn.Module,
    packed: "PackedMicroBatch",  # noqa: F821  (vime_core.trainer.packing)
    vocab_size: int,
    sampling: float | Sampling = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The full head: logits at every position, then the response rows (reference and baseline)."""
    logits = forward_packed(model, packed)
    response_logits = logits[0].index_select(0, packed.logit_index)
    return log_probs_and_entropy(response_logits, packed.targets, vocab_size, sampling, with_entropy, entropy_grad)


# ---- the trainer's head: response rows only, in chunks of rows --------------------------------------------


def packed_response_log_probs(
    model: torch.nn.Module,
    packed: "PackedMicroBatch",  # noqa: F821  (vime_core.trainer.packing)
    vocab_size: int,
    sampling: float | Sampling = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Forward a packed micro-batch and return its response tokens' log-probs (and entropy),
    flat over the samples in order (``sum(response_lengths)`` long), float32. ``sampling``: the
    rollout's temperature, or its ``Sampling`` (temperature, top-k, top-p: truncation.py)."""
    gpt = unwrap(model)
    with hidden_states_only(gpt):
        hidden = forward_packed(model, packed)  # [T, 1, hidden]: the decoder's output after the final norm
    rows = hidden[:, 0].index_select(0, packed.logit_index)
    return response_log_probs(
        rows, output_weight(gpt), packed.targets, vocab_size, sampling, with_entropy, entropy_grad
    )


def forward_packed(model: torch.nn.Module, packed: "PackedMicroBatch") -> torch.Tensor:  # noqa: F821
    """The model on a THD-packed micro-batch: attention is causal inside each sample (cu_seqlens)."""
    return model(packed.input_ids, packed.position_ids, None, packed_seq_params=packed.packed_seq_params())


@contextmanager
def hidden_states_only(gpt: Any) -> Iterator[None]:
    """Inside: ``gpt``'s forward returns the final hidden states [s, b, h] instead of logits.

    Megatron's GPTModel returns the decoder's output (final norm included: the decoder owns it)
    when ``post_process`` is off, as a pipeline stage without the output layer does."""
    previous = gpt.post_process
    gpt.post_process = False
    try:
        yield
    finally:
        gpt.post_process = previous


def output_weight(gpt: Any) -> torch.Tensor:
    """This rank's output (LM head) weight [V_r, h]: the word embeddings when tied."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def response_log_probs(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    sampling: float | Sampling = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``rows`` [N, h] final hidden states, ``weight`` [V_r, h] this rank's output weights,
    ``targets`` [N] global ids -> (log_probs [N], entropy [N] or None), float32.

    The entropy is differentiable only when ``entropy_grad``; otherwise it is a metric computed
    in the same pass (no backward work). ``sampling``: the temperature, or the ``Sampling``."""
    sampling = as_sampling(sampling)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    comm = _tp_collectives(parallel_state)
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]
    if tp_size > 1:
        rows = copy_to_tensor_model_parallel_region(rows)
    return head_log_probs(rows, weight, targets, start, vocab_size, sampling, with_entropy, entropy_grad, comm)


def head_log_probs(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    start: int,
    vocab_size: int,
    sampling: Sampling,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    comm: Optional[Collectives] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``ResponseHead`` of the rank whose slice starts at id ``start``, its TP group's
    collectives ``comm`` (None: one rank); ``rows`` already copied to the TP region."""
    top_k, top_p = (sampling.top_k, sampling.top_p) if sampling.truncates(vocab_size) else (-1, 1.0)
    log_probs, entropy = ResponseHead.apply(
        rows,
        weight,
        targets,
        start,
        vocab_size,
        float(sampling.temperature),
        with_entropy,
        with_entropy and entropy_grad,
        comm,
        top_k,
        top_p,
    )
    return log_probs, entropy if with_entropy else None


def chunk_rows(columns: int) -> int:
    """Rows per chunk: about ``CHUNK_ELEMENTS`` logits."""
    return max(1, CHUNK_ELEMENTS // max(columns, 1))


class ResponseHead(torch.autograd.Function):
    """log p(a) and H of N rows over this rank's vocabulary slice, chunk by chunk.

    Forward, per row, with m = max_v y_v, s = sum_v exp(y_v - m), t = sum_v exp(y_v - m) (y_v - m) over
    the rank's real columns: lse = m + log s, log p(a) = y_a - lse, H = log s - t / s. Over TP ranks r
    the (m_r, s_r, t_r) merge by an all-reduce MAX of M = max_r m_r, then a SUM of
    s = sum_r c_r s_r, t = sum_r c_r (t_r + (m_r - M) s_r), c_r = exp(m_r - M), and of y_a (its owner's).

    Backward recomputes each chunk's logits (only lse and H per row are kept):
    g_y = g_logp ([v = a] - p) - g_H p (log p + H), g_z = g_y / tau, g_x = g_z W, g_W = sum g_z^T x
    (accumulated in fp32). x enters through copy_to_tensor_model_parallel_region, so each rank's g_x
    covers its vocabulary slice, as in the output layer's own backward. Logits stay in the model dtype,
    softmax quantities in fp32; g_z is rounded back to the model dtype before the two matmuls.

    With top-k / top-p each chunk (a quarter of the rows) selects the kept set (`truncation.select`),
    keeps (tau, w_tie) per row and rebuilds w in the backward from the recomputed logits. The chunk
    math is elementwise and memory-bound, so on CUDA it runs through torch.compile (`run_chunk_fn`)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        start: int,
        vocab_size: int,
        temperature: float,
        with_entropy: bool,
        entropy_grad: bool,
        comm: Optional[Collectives],
        top_k: int = -1,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = x.shape[0]
        valid = max(0, min(weight.shape[0], vocab_size - start))  # columns that are real tokens
        w = weight[:valid]
        local = targets - start
        parts = []
        sampling = Sampling(temperature, top_k, top_p)
        truncated = sampling.truncates(vocab_size)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tau, w_tie) per chunk
        if truncated:  # every rank runs every chunk (the selection's collectives), the same rows
            rows = max(1, chunk_rows(weight.shape[0]) // TRUNCATED_CHUNK_DIVISOR)
            for r0 in range(0, n, rows):
                r1 = min(n, r0 + rows)
                *stats, tau, w_tie = truncated_forward_chunk(
                    x[r0:r1], w, local[r0:r1], sampling, with_entropy, vocab_size, weight.shape[0], comm
                )
                kept.append((tau, w_tie))
                if valid:
                    parts.append(stats)
        else:
            rows = chunk_rows(valid)
            for r0 in range(0, n if valid else 0, rows):
                r1 = min(n, r0 + rows)
                parts.append(run_chunk_fn(forward_chunk, x[r0:r1], w, local[r0:r1], temperature, with_entropy))
        if parts:
            m, s, y_a = (torch.cat([p[i] for p in parts]) for i in (0, 1, 3))
            t = torch.cat([p[2] for p in parts]) if with_entropy else None
        else:  # no row, or no real token in this slice (a tiny vocabulary over many ranks)
            m = torch.full((n,), torch.finfo(torch.float32).min, device=x.device)
            s, y_a = torch.zeros(n, device=x.device), torch.zeros(n, device=x.device)
            t = torch.zeros(n, device=x.device) if with_entropy else None
        if comm is not None:
            m, s, t, y_a = all_reduce_stats(m, s, t, y_a, comm)
        log_s = s.log()
        lse = m + log_s
        log_probs = y_a - lse
        entropy = log_s - t / s if with_entropy else torch.empty(0, device=x.device)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        tau = torch.cat([k[0] for k in kept]) if kept else None
        w_tie = torch.cat([k[1] for k in kept]) if kept else None
        ctx.save_for_backward(x, weight, local, lse, entropy if entropy_grad else None, tau, w_tie)
        ctx.temperature, ctx.valid, ctx.entropy_grad, ctx.rows = temperature, valid, entropy_grad, rows
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor]) -> tuple:  # type: ignore[override]
        x, weight, local, lse, entropy, tau, w_tie = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, valid = x.shape[0], ctx.valid
        if grad_log_probs is None:
            grad_log_probs = torch.zeros(n, dtype=torch.float32, device=x.device)
        if not ctx.entropy_grad:
            grad_entropy = None
        w = weight[:valid]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_w = torch.zeros_like(weight) if want_w else None  # padding rows keep 0
        rows = ctx.rows  # the forward's chunks: the kept sets were chosen on their logits
        chunks = range(0, n if valid else 0, rows)
        # g_W sums over chunks in fp32 (one matmul of the full head rounds once); one chunk: direct
        acc = torch.zeros(w.shape, dtype=torch.float32, device=x.device) if want_w and len(chunks) > 1 else None
        for r0 in chunks:
            r1 = min(n, r0 + rows)
            g_ent = None if grad_entropy is None else grad_entropy[r0:r1]
            ent = None if grad_entropy is None else entropy[r0:r1]
            kept = () if tau is None else (tau[r0:r1], w_tie[r0:r1])
            grad_z = run_chunk_fn(
                backward_chunk,
                x[r0:r1],
                w,
                local[r0:r1],
                lse[r0:r1],
                ent,
                grad_log_probs[r0:r1],
                g_ent,
                ctx.temperature,
                *kept,
            )
            if want_x:
                torch.mm(grad_z, w, out=grad_x[r0:r1])
            if want_w:
                if acc is None:
                    torch.mm(grad_z.t(), x[r0:r1], out=grad_w[:valid])
                else:
                    acc += grad_z.t() @ x[r0:r1]
        if acc is not None:
            grad_w[:valid] = acc
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def run_chunk_fn(fn: Callable[..., Any], x: torch.Tensor, *args: Any) -> Any:
    """``fn(x, *args)``: compiled on CUDA while ``COMPILE_ON_CUDA`` (``compiled.run_compiled``)."""
    return run_compiled(fn, x, *args, enabled=COMPILE_ON_CUDA)


def forward_chunk(
    x: torch.Tensor, w: torch.Tensor, local: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """One chunk's per-row (m, s, t or None, y_a where the target is one of w's rows else 0)."""
    y = (x @ w.t()).float()  # a fresh tensor (the matmul's output, or its fp32 copy)
    if temperature != 1.0:
        y.div_(temperature)
    inside = (local >= 0) & (local < y.shape[1])
    y_a = y.gather(1, local.clamp(0, y.shape[1] - 1).unsqueeze(1)).squeeze(1)
    y_a = torch.where(inside, y_a, 0.0)
    m = y.amax(dim=1)
    shifted = y.sub_(m.unsqueeze(1))
    if not with_entropy:
        return m, shifted.exp_().sum(dim=1), None, y_a
    e = shifted.exp()
    s = e.sum(dim=1)
    t = e.mul_(shifted).sum(dim=1)
    return m, s, t, y_a


def all_reduce_stats(
    m: torch.Tensor, s: torch.Tensor, t: Optional[torch.Tensor], target_logit: torch.Tensor, comm: Collectives
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The TP ranks' (m, s, t) merged (ResponseHead's docstring) and the target logit summed (one owner)."""
    top = comm.all_reduce(m, "max")
    c = (m - top).exp()
    parts = [c * s, target_logit] + ([] if t is None else [c * (t + (m - top) * s)])
    summed = comm.all_reduce(torch.stack(parts), "sum")
    return top, summed[0], (None if t is None else summed[2]), summed[1]


def backward_chunk(
    x: torch.Tensor,
    w: torch.Tensor,
    local: torch.Tensor,
    lse: torch.Tensor,
    entropy: Optional[torch.Tensor],
    grad_log_probs: torch.Tensor,
    grad_entropy: Optional[torch.Tensor],
    temperature: float,
    tau: Optional[torch.Tensor] = None,
    w_tie: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """g_z of one chunk in the model dtype: g_y = g_logp ([v = a] - p) - g_H p (log p + H), / T
    (T: the temperature; with a kept set (``tau``, ``w_tie``), p_v = w_v exp(y_v - lse)).

    Written as one elementwise expression over the logits (the target term by comparing column
    ids, not a scatter) so that torch.compile makes it a single kernel after the matmul."""
    y = (x @ w.t()).float()
    if temperature != 1.0:
        y.div_(temperature)
    hit = torch.arange(y.shape[1], device=y.device).unsqueeze(0) == local.unsqueeze(1)
    weights = None if tau is None else keep_weights(y, hit, tau, w_tie)
    log_p = y.sub_(lse.unsqueeze(1))
    g = grad_log_probs.unsqueeze(1)
    coef = g if grad_entropy is None else log_p.add(entropy.unsqueeze(1)).mul_(grad_entropy.unsqueeze(1)).add_(g)
    grad_y = log_p.exp_().mul_(coef).neg_()  # -p * coef (log_p is spent)
    if weights is not None:
        grad_y.mul_(weights)
    grad_y.add_(torch.where(hit, g, 0.0))  # a target outside this slice matches no column
    if temperature != 1.0:
        grad_y.div_(temperature)
    return grad_y.to(x.dtype)


def truncated_forward_chunk(
    x: torch.Tensor,
    w: torch.Tensor,
    local: torch.Tensor,
    sampling: Sampling,
    with_entropy: bool,
    vocab_size: int,
    width: int,
    comm: Optional[Collectives],
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's per-row (m, s, t or None, y_a, tau, w_tie) over the kept set: the selection
    (collectives over the TP group), then the weighted sums (``truncated_stats``)."""
    y = (x @ w.t()).float()
    if sampling.temperature != 1.0:
        y.div_(sampling.temperature)
    tau, w_tie = select(y, local, sampling, vocab_size, width, comm)
    if not y.shape[1]:  # no real token in this rank's slice
        return (
            torch.full_like(tau, torch.finfo(torch.float32).min),
            torch.zeros_like(tau),
            torch.zeros_like(tau) if with_entropy else None,
            torch.zeros_like(tau),
            tau,
            w_tie,
        )
    return (*run_chunk_fn(truncated_stats, y, local, tau, w_tie, with_entropy), tau, w_tie)


def truncated_stats(
    y: torch.Tensor, local: torch.Tensor, tau: torch.Tensor, w_tie: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``forward_chunk``'s (m, s, t, y_a) of tempered logits ``y`` with each term weighted by
    w_v: s = sum_v w_v exp(y_v - m), t = sum_v w_v exp(y_v - m) (y_v - m)."""
    hit = torch.arange(y.shape[1], device=y.device).unsqueeze(0) == local.unsqueeze(1)
    weights = keep_weights(y, hit, tau, w_tie)
    inside = (local >= 0) & (local < y.shape[1])
    y_a = y.gather(1, local.clamp(0, y.shape[1] - 1).unsqueeze(1)).squeeze(1)
    y_a = torch.where(inside, y_a, 0.0)
    m = y.amax(dim=1)
    shifted = y.sub_(m.unsqueeze(1))
    e = shifted.exp().mul_(weights)
    s = e.sum(dim=1)
    t = e.mul_(shifted).sum(dim=1) if with_entropy else None
    return m, s, t, y_a
