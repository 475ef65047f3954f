"""Both heads under top-k / top-p through Megatron's TP state: the full-logits head
(``log_probs_and_entropy``) against the chunked response head at TP=1, and two TP ranks over gloo
(torch.distributed collectives, Megatron's copy-to-TP-region) against the formula on one
process: log p'(a) = y_a - logsumexp_{v in S} y_v, the entropy over S and the gradients."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.trainer.dist_workers import spawn
from tests.unit.test_truncated_log_probs import GRAD_TOL, grads, kept_mask, targets_in
from vime_core.trainer.truncation import Sampling

ATOL = 1e-5
SAMPLINGS = [Sampling(0.7, top_k=6), Sampling(0.8, top_p=0.85), Sampling(1.2, top_k=9, top_p=0.6)]


def _inputs(seed: int, rows: int, hidden: int, padded: int, vocab: int, sampling: Sampling):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 2).requires_grad_()
    w = torch.randn(padded, hidden, generator=gen).requires_grad_()
    keep = kept_mask((x @ w[:vocab].t()).detach() / sampling.temperature, sampling.top_k, sampling.top_p)
    return x, w, targets_in(keep, gen), torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["top_k", "top_p", "both"])
def test_full_head_matches_the_response_head(single_rank, sampling):
    from vime_core.trainer.logprobs import log_probs_and_entropy, response_log_probs

    x, w, targets, a, b = _inputs(0, 9, 16, 40, 37, sampling)
    lp, ent = response_log_probs(x, w, targets, 37, sampling, with_entropy=True)
    ref_lp, ref_ent = log_probs_and_entropy(x @ w.t(), targets, 37, sampling, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    for ours, ref in zip(grads(x, w, lp, ent, a, b), grads(x, w, ref_lp, ref_ent, a, b)):
        torch.testing.assert_close(ours, ref, **GRAD_TOL)
    assert (lp - (x @ w[:37].t() / sampling.temperature).log_softmax(-1)[torch.arange(9), targets]).max() > 1e-3


def _tp2_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """One TP rank of a 20-row output layer (19 tokens + 1 padding): both heads, every sampling."""
    torch.set_num_threads(1)
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    import vime_core.trainer.truncation as truncation
    from vime_core.trainer.logprobs import log_probs_and_entropy, response_log_probs
    from vime_core.trainer.parallel import destroy_parallel, init_parallel

    truncation.FIRST_CANDIDATES = 2  # top-p rows resolve over several gathers
    init_parallel(rank, world_size, "127.0.0.1", port, tp_size=2)
    results = []
    for i, sampling in enumerate(SAMPLINGS):
        x, w, targets, a, b = _inputs(10 + i, 6, 8, 20, 19, sampling)
        w_local = w.detach()[rank * 10 : (rank + 1) * 10].clone().requires_grad_()
        for head in ("chunked", "full"):
            if head == "chunked":
                lp, ent = response_log_probs(x, w_local, targets, 19, sampling, with_entropy=True)
            else:
                # the output layer's input enters the TP region as in Megatron's (all-reduced g_x)
                logits = copy_to_tensor_model_parallel_region(x) @ w_local.t()
                lp, ent = log_probs_and_entropy(logits, targets, 19, sampling, with_entropy=True)
            gx, gw = grads(x, w_local, lp, ent, a, b)
            results.append({"lp": lp.detach(), "ent": ent.detach(), "gx": gx, "gw": gw})
    torch.save(results, Path(out) / f"rank{rank}.pt")
    destroy_parallel()


@pytest.mark.slow
def test_tp2_heads_match_the_formula(tmp_path):
    spawn(_tp2_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for i, sampling in enumerate(SAMPLINGS):
        x, w, targets, a, b = _inputs(10 + i, 6, 8, 20, 19, sampling)
        y = (x @ w[:19].t()) / sampling.temperature
        keep = kept_mask(y.detach(), sampling.top_k, sampling.top_p)
        log_p = torch.where(keep, y, float("-inf")).log_softmax(-1)
        ref_lp = log_p[torch.arange(6), targets]
        ref_ent = -(log_p.exp() * torch.where(keep, log_p, 0.0)).sum(-1)
        ref_gx, ref_gw = grads(x, w, ref_lp, ref_ent, a, b)
        for head in range(2):
            for rank in range(2):
                got = ranks[rank][2 * i + head]
                torch.testing.assert_close(got["lp"], ref_lp.detach(), atol=ATOL, rtol=0)
                torch.testing.assert_close(got["ent"], ref_ent.detach(), atol=ATOL, rtol=0)
                torch.testing.assert_close(got["gx"], ref_gx, **GRAD_TOL)  # all-reduced over TP
                torch.testing.assert_close(got["gw"], ref_gw[rank * 10 : (rank + 1) * 10], **GRAD_TOL)


def test_truncated_chunk_functions_trace_under_torch_compile():
    """What CUDA runs through torch.compile with a kept set (dynamo + AOT autograd, the graph
    inductor lowers): the eager results for truncated_stats and backward_chunk with (tau, w_tie)."""
    import vime_core.trainer.logprobs as logprobs
    from vime_core.trainer.truncation import select

    torch._dynamo.reset()
    stats = torch.compile(logprobs.truncated_stats, dynamic=True, backend="aot_eager")
    bwd = torch.compile(logprobs.backward_chunk, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(37, 16, generator=gen)
    for n in (7, 13):
        x = torch.randn(n, 16, generator=gen)
        local = torch.randint(-5, 42, (n,), generator=gen)  # some targets outside the slice
        y = (x @ w.t()) / 0.7
        tau, w_tie = select(y, local, Sampling(0.7, top_k=9, top_p=0.8), 37, 37)
        for with_entropy in (False, True):
            for ours, ref in zip(
                stats(y.clone(), local, tau, w_tie, with_entropy),
                logprobs.truncated_stats(y.clone(), local, tau, w_tie, with_entropy),
            ):
                assert (ours is None) == (ref is None)
                if ref is not None:
                    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        lse, ent, g, g_ent = (
            torch.randn(n, generator=gen) + 5,
            torch.rand(n, generator=gen),
            torch.randn(n),
            torch.randn(n),
        )
        for entropy_args in ((None, None), (ent, g_ent)):
            args = (x, w, local, lse, entropy_args[0], g, entropy_args[1], 0.7, tau, w_tie)
            torch.testing.assert_close(bwd(*args), logprobs.backward_chunk(*args), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
