"""The response head's log-probs under top-k / top-p (vime_core/trainer/truncation.py): against
log p'(a) = y_a - logsumexp_{v in S} y_v with S built here from vLLM's rule by sorting, their
entropy and gradients; exact ties; the sampled token outside S; two TP ranks simulated in threads
(``Collectives`` over a barrier) against one; and the default path (no truncation) untouched."""

from __future__ import annotations

import threading

import pytest
import torch

import vime_core.trainer.logprobs as logprobs
import vime_core.trainer.truncation as truncation
from vime_core.trainer.logprobs import head_log_probs
from vime_core.trainer.truncation import Sampling

VOCAB, PADDED, HIDDEN, ROWS = 37, 40, 16, 11
ATOL = 1e-5
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)


def kept_mask(y: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's kept set of each row of ``y`` [N, V] (no ties here): the top_k largest, then over
    them renormalised the most probable tokens while the mass before each is < top_p."""
    order = y.argsort(dim=1, descending=True)
    ranked = y.gather(1, order)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if 0 < top_k < y.shape[1]:
        keep[:, top_k:] = False
    probs = torch.where(keep, ranked, float("-inf")).softmax(dim=1)
    before = probs.cumsum(dim=1) - probs
    keep &= before < top_p
    return torch.zeros_like(keep).scatter(1, order, keep)


def reference(x, w, targets, sampling: Sampling, keep=None):
    """(log p'(a), H over S, S) from the formula with plain torch: y = x W^T / T masked to S."""
    y = (x @ w[:VOCAB].t()) / sampling.temperature
    if keep is None:
        keep = kept_mask(y.detach(), sampling.top_k, sampling.top_p)
    log_p = torch.where(keep, y, float("-inf")).log_softmax(dim=1)
    entropy = -(log_p.exp() * torch.where(keep, log_p, 0.0)).sum(dim=1)
    return log_p[torch.arange(len(targets)), targets], entropy, keep


def inputs(seed: int, rows: int = ROWS):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, HIDDEN, generator=gen) * 2).requires_grad_()
    w = torch.randn(PADDED, HIDDEN, generator=gen).requires_grad_()
    a, b = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)
    return x, w, a, b, gen


def targets_in(keep: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token of each row's kept set, as the engine would have sampled."""
    return torch.multinomial(keep.float(), 1, generator=gen).squeeze(1)


def grads(x, w, lp, ent, a, b):
    return torch.autograd.grad((a * lp).sum() + (b * ent).sum(), (x, w))


@pytest.fixture
def small_chunks(monkeypatch):
    """A few rows per chunk, so the selection and the backward run over several chunks."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 8 * PADDED)  # 8 rows, 2 with truncation


CASES = [
    Sampling(0.7, top_k=5),
    Sampling(0.7, top_p=0.9),
    Sampling(1.3, top_k=12, top_p=0.6),
    Sampling(0.5, top_k=0, top_p=0.3),  # top_k 0 is off, as in vLLM
]


@pytest.mark.parametrize("sampling", CASES, ids=["top_k", "top_p", "both", "k0_small_p"])
def test_log_probs_entropy_and_gradients_match_the_formula(small_chunks, sampling):
    x, w, a, b, gen = inputs(seed=1)
    _, _, keep = reference(x.detach(), w.detach(), torch.zeros(ROWS, dtype=torch.long), sampling)
    assert keep.sum(dim=1).lt(VOCAB).all()  # every row truncated
    targets = targets_in(keep, gen)
    ref_lp, ref_ent, _ = reference(x, w, targets, sampling)
    lp, ent = head_log_probs(x, w, targets, 0, VOCAB, sampling, with_entropy=True)
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    full = (x @ w[:VOCAB].t() / sampling.temperature).log_softmax(dim=1)[torch.arange(ROWS), targets]
    assert (lp - full).max() > 0.01 and (lp - full).min() > -ATOL  # renormalised over S: never lower
    for ours, ref in zip(grads(x, w, lp, ent, a, b), grads(x, w, ref_lp, ref_ent, a, b)):
        torch.testing.assert_close(ours, ref, **GRAD_TOL)


def test_no_truncation_runs_the_default_path_unchanged(small_chunks, monkeypatch):
    """top_p 1 with top_k -1, 0 or >= the vocabulary: the plain tempered softmax, and the
    selection never runs."""
    monkeypatch.setattr(logprobs, "select", lambda *a, **k: pytest.fail("the selection ran"))
    x, w, a, b, gen = inputs(seed=2)
    targets = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    logits = x @ w[:VOCAB].t() / 0.8
    ref_lp = logits.log_softmax(dim=1)[torch.arange(ROWS), targets]
    ref_ent = -(logits.softmax(dim=1) * logits.log_softmax(dim=1)).sum(dim=1)
    plain = head_log_probs(x, w, targets, 0, VOCAB, Sampling(0.8), with_entropy=True)
    for sampling in (Sampling(0.8, top_k=0), Sampling(0.8, top_k=VOCAB), Sampling(0.8, top_k=10**6, top_p=1.0)):
        lp, ent = head_log_probs(x, w, targets, 0, VOCAB, sampling, with_entropy=True)
        assert torch.equal(lp, plain[0]) and torch.equal(ent, plain[1])
    torch.testing.assert_close(plain[0], ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(plain[1], ref_ent, atol=ATOL, rtol=0)
    for ours, ref in zip(grads(x, w, *plain, a, b), grads(x, w, ref_lp, ref_ent, a, b)):
        torch.testing.assert_close(ours, ref, **GRAD_TOL)


def test_a_sampled_token_outside_the_kept_set_is_added_to_it():
    """log p'(a) = y_a - log(sum_{v in S} e^{y_v} + e^{y_a}): finite, where S alone gives -inf."""
    sampling = Sampling(0.9, top_p=0.5)
    x, w, a, b, gen = inputs(seed=3)
    y = (x @ w[:VOCAB].t()).detach() / 0.9
    keep = kept_mask(y, -1, 0.5)
    targets = targets_in(~keep, gen)  # every row's token outside S
    ref_lp, _, _ = reference(x, w, targets, sampling, keep=keep | torch.nn.functional.one_hot(targets, VOCAB).bool())
    lp, ent = head_log_probs(x, w, targets, 0, VOCAB, sampling, with_entropy=True)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    gx, gw = grads(x, w, lp, ent, a, b)
    assert torch.isfinite(gx).all() and torch.isfinite(gw).all()


def exact_rows(values: list[list[float]]):
    """Hidden states and an identity output layer whose logits are exactly ``values``: ties stay ties."""
    y = torch.tensor(values)
    x = torch.zeros(len(values), PADDED)
    x[:, :VOCAB] = y
    return x.requires_grad_(), torch.eye(PADDED).requires_grad_()


def tied_logits(gen: torch.Generator, rows: int) -> list[list[float]]:
    """Logits on a grid of 0.25 (as bf16 rounds them): many exact ties, some at each boundary."""
    return (torch.randint(0, 12, (rows, VOCAB), generator=gen).float() * 0.25).tolist()


def count_rule_log_prob(y: torch.Tensor, target: int, sampling: Sampling) -> float:
    """vLLM's value on tied logits: only how many of the tied boundary tokens are kept matters;
    taken one after another in any order, as many as the rule keeps."""
    ranked = y.sort(descending=True).values
    n = sampling.top_k if 0 < sampling.top_k < len(y) else len(y)
    probs = ranked[:n].softmax(dim=0)
    n = int(((probs.cumsum(dim=0) - probs) < sampling.top_p).sum())
    return float(y[target] - ranked[:n].logsumexp(dim=0))


TIED_CASES = [Sampling(1.0, top_k=7), Sampling(1.0, top_p=0.45), Sampling(1.0, top_k=9, top_p=0.7)]


@pytest.mark.parametrize("sampling", TIED_CASES, ids=["top_k", "top_p", "both"])
def test_exact_ties_keep_the_count_vllm_keeps(sampling):
    gen = torch.Generator().manual_seed(4)
    values = tied_logits(gen, 16)
    y = torch.tensor(values)
    x, w = exact_rows(values)
    tau, w_tie = truncation.select(y, torch.zeros(16, dtype=torch.long), sampling, VOCAB, PADDED)
    assert ((w_tie > 0) & (w_tie < 1)).sum() >= 2  # rows that keep only some of their tied tokens
    # every row's token: one above the boundary and one of the tied tokens at it
    for pick in (
        lambda row, t: int(torch.nonzero(row > t)[0]) if (row > t).any() else int(torch.nonzero(row == t)[0]),
        lambda row, t: int(torch.nonzero(row == t)[-1]),
    ):
        targets = torch.tensor([pick(y[i], tau[i]) for i in range(16)])
        lp, _ = head_log_probs(x, w, targets, 0, VOCAB, sampling)
        expected = torch.tensor([count_rule_log_prob(y[i], int(targets[i]), sampling) for i in range(16)])
        torch.testing.assert_close(lp, expected, atol=ATOL, rtol=0)


# ---- two TP ranks in threads ---------------------------------------------------------------------


class ThreadGroup:
    """A TP group of ``size`` threads: each collective is a rendezvous on a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=60)
        self.slots: list = [None] * size


class ThreadCollectives:
    def __init__(self, group: ThreadGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.slots[self.rank] = tensor.clone()
        self.group.barrier.wait()
        out = torch.stack(self.group.slots)
        self.group.barrier.wait()  # everyone has read before the next collective writes
        return out

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        gathered = self.all_gather(tensor)  # summed in rank order: the same on every rank
        return gathered.sum(dim=0) if op == "sum" else gathered.amax(dim=0)


def run_ranks(size: int, fn) -> list:
    """``fn(rank, collectives)`` on ``size`` threads; their results in rank order."""
    group, results, errors = ThreadGroup(size), [None] * size, []

    def run(rank):
        try:
            results[rank] = fn(rank, ThreadCollectives(group, rank))
        except BaseException as exc:  # re-raised below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("sampling", CASES + [Sampling(0.8)], ids=["top_k", "top_p", "both", "k0_small_p", "none"])
def test_two_tp_ranks_give_the_single_rank_values_and_gradients(small_chunks, monkeypatch, sampling):
    """Ranks 0 and 1 each hold 20 rows of the 40-row output layer (ids 37..39: padding on rank
    1). Top-p without top-k gathers 2 values per rank at first, so rows need several rounds."""
    monkeypatch.setattr(truncation, "FIRST_CANDIDATES", 2)
    x, w, a, b, gen = inputs(seed=5)
    _, _, keep = reference(x.detach(), w.detach(), torch.zeros(ROWS, dtype=torch.long), sampling)
    targets = targets_in(keep, gen)
    lp1, ent1 = head_log_probs(x, w, targets, 0, VOCAB, sampling, with_entropy=True)
    gx1, gw1 = grads(x, w, lp1, ent1, a, b)
    half = PADDED // 2

    def rank(r, comm):
        x_r = x.detach().clone().requires_grad_()
        w_r = w.detach()[r * half : (r + 1) * half].clone().requires_grad_()
        lp, ent = head_log_probs(x_r, w_r, targets, r * half, VOCAB, sampling, with_entropy=True, comm=comm)
        return (lp.detach(), ent.detach(), *grads(x_r, w_r, lp, ent, a, b))

    results = run_ranks(2, rank)
    for lp, ent, _, _ in results:
        torch.testing.assert_close(lp, lp1.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(ent, ent1.detach(), atol=ATOL, rtol=0)
    # g_x: each rank's share over its slice, summed by the TP all-reduce of the real head
    torch.testing.assert_close(results[0][2] + results[1][2], gx1, **GRAD_TOL)
    torch.testing.assert_close(torch.cat([results[0][3], results[1][3]]), gw1, **GRAD_TOL)


def test_two_tp_ranks_select_the_single_rank_set_on_tied_logits(monkeypatch):
    """Ties split over the ranks: the same tau and tie weight as one rank, also when rows
    resolve in different rounds."""
    monkeypatch.setattr(truncation, "FIRST_CANDIDATES", 2)
    gen = torch.Generator().manual_seed(6)
    y = torch.tensor(tied_logits(gen, 24))
    targets = torch.randint(0, VOCAB, (24,), generator=gen)
    half = PADDED // 2
    for sampling in (Sampling(1.0, top_k=6), Sampling(1.0, top_p=0.8), Sampling(1.0, top_k=15, top_p=0.5)):
        one = truncation.select(y, targets, sampling, VOCAB, PADDED)
        two = run_ranks(
            2,
            lambda r, comm: truncation.select(
                y[:, r * half : min(VOCAB, (r + 1) * half)], targets - r * half, sampling, VOCAB, half, comm
            ),
        )
        for tau, w_tie in two:
            assert torch.equal(tau, one[0]) and torch.equal(w_tie, one[1])
