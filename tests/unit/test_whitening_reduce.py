"""Whitening over the whole step when the step is spread over DP ranks (masked_whiten's reduce_sums).

Two "ranks" run in two threads of this process, each on its share of one step; their reducer
sums the partial sums both deposit (by hand: tensor addition after a barrier), as an all-reduce
would. Each rank's advantages must be those of whitening the whole step in one call.
"""

from __future__ import annotations

import threading

import pytest
import torch

from vime_core.algo.advantages import compute_advantages, masked_whiten

GAMMA, LAMBD, KL_COEF = 0.9, 0.8, 0.1


class _TwoRanks:
    """An in-process all-reduce(sum) between `world` threads, counting the calls of each rank."""

    def __init__(self, world: int = 2) -> None:
        self.barrier = threading.Barrier(world, timeout=10)
        self.deposits: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def reducer(self, rank: int):
        def reduce_sums(sums: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.deposits[rank] = sums.clone()
            self.barrier.wait()
            total = sum(self.deposits[1:], self.deposits[0].clone())
            self.barrier.wait()  # every rank has read before the next call overwrites
            return total

        return reduce_sums

    def run(self, fn, shares):
        """fn(share, reducer) on each rank's share, in threads; the per-rank results."""
        out, errors = [None] * len(shares), []

        def target(rank):
            try:
                out[rank] = fn(shares[rank], self.reducer(rank))
            except BaseException as exc:  # surfaced below, not lost in the thread
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(len(shares))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


def _step():
    """8 samples: the first four of flat groups (centred reward 0, KL noise ~1e-3), the last four
    of mixed ones; tool spans in two."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 7, 3, 6, 4, 8, 5, 6]
    rewards = [0.0, 0.0, 0.0, 0.0, 0.5, -0.5, -0.5, 0.5]  # group-centred: two flat groups, two mixed
    masks = [torch.ones(n) for n in lengths]
    masks[1][2:5] = 0
    masks[6][1:3] = 0
    kl = [torch.rand(n, generator=g) * 1e-2 for n in lengths]
    values = [torch.rand(n, generator=g) for n in lengths]
    return rewards, masks, kl, values


def _advantages(estimator, rewards, masks, kl, values, reduce_sums=None):
    return compute_advantages(
        estimator,
        rewards,
        masks,
        kl=kl,
        values=values,
        gamma=GAMMA,
        lambd=LAMBD,
        kl_coef=KL_COEF,
        reduce_sums=reduce_sums,
    )


def test_masked_whiten_of_two_shares_equals_the_whole():
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=g) + 5.0 for n in (4, 6, 3, 5)]
    masks = [torch.tensor(m) for m in ([1, 1, 0, 1], [1, 0, 0, 1, 1, 1], [1, 1, 1], [0, 1, 1, 1, 1])]
    whole = masked_whiten(values, masks)
    ranks = _TwoRanks()
    shares = [(values[:2], masks[:2]), (values[2:], masks[2:])]
    halves = ranks.run(lambda share, reduce: masked_whiten(*share, reduce), shares)
    torch.testing.assert_close(torch.cat(halves[0] + halves[1]), torch.cat(whole), atol=1e-6, rtol=0)
    assert ranks.calls == [2, 2]  # (count, sum) then the centred sum of squares: two collectives
    # the whole step's moments, not one share's
    model = torch.cat(halves[0] + halves[1])[torch.cat(masks) != 0].double()
    assert model.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert model.std().item() == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"])
def test_estimators_on_two_shares_equal_the_whole_step(estimator):
    rewards, masks, kl, values = _step()
    whole, whole_returns = _advantages(estimator, rewards, masks, kl, values)
    shares = [tuple(x[:4] for x in (rewards, masks, kl, values)), tuple(x[4:] for x in (rewards, masks, kl, values))]
    ranks = _TwoRanks()
    results = ranks.run(lambda share, reduce: _advantages(estimator, *share, reduce_sums=reduce), shares)
    advantages = results[0][0] + results[1][0]
    for ours, ref in zip(advantages, whole, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    for ours, ref in zip(results[0][1] + results[1][1], whole_returns, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)
    if estimator == "reinforce_plus_plus_baseline":  # the case: group-centred rewards 0, KL noise
        alone, _ = _advantages(estimator, *shares[0])
        assert max(a.abs().max().item() for a in alone) > 1.0  # the flat rank alone: noise whitened to O(1)
        assert max(a.abs().max().item() for a in advantages[:4]) < 0.1  # over the step: small


def test_a_rank_without_samples_still_joins_the_reduction():
    rewards, masks, kl, values = _step()
    whole, _ = _advantages("reinforce_plus_plus", rewards, masks, kl, values)
    ranks = _TwoRanks()
    empty = ([], [], [], [])
    results = ranks.run(
        lambda share, reduce: _advantages("reinforce_plus_plus", *share, reduce_sums=reduce),
        [(rewards, masks, kl, values), empty],
    )
    assert results[1] == ([], []) and ranks.calls == [2, 2]
    for ours, ref in zip(results[0][0], whole, strict=True):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=0)


def test_a_step_with_fewer_than_two_model_tokens_is_not_divided_and_every_rank_agrees():
    """n < 2 over the step: whiten(x) = m * x; both ranks stop after the first reduction."""
    ranks = _TwoRanks()
    shares = [([torch.tensor([0.7, 9.0])], [torch.tensor([1, 0])]), ([torch.tensor([3.0])], [torch.tensor([0])])]
    out = ranks.run(lambda share, reduce: masked_whiten(*share, reduce), shares)
    assert out[0][0].tolist() == pytest.approx([0.7, 0.0]) and out[1][0].tolist() == [0.0]
    assert ranks.calls == [1, 1]
