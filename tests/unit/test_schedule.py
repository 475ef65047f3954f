"""The DP schedule: a batch split into steps, micro-batches and DP ranks (the build phase)."""

from __future__ import annotations

import random

import pytest

from vime_core.data.schedule import build_dp_schedule


def test_reference_one_step_dp4():
    n, gbs, mbs, dp = 256, 256, 8, 4
    sched = build_dp_schedule([100] * n, gbs, dp, mbs)
    assert sched.num_microbatches == [gbs // dp // mbs]
    assert sched.num_microbatches == [8]
    for rank in range(dp):
        assert len(sched.partition(rank)) == n // dp == 64
        assert all(len(mb) == mbs for mb in sched.micro_batches[rank][0])
    assert sorted(i for r in range(dp) for i in sched.partition(r)) == list(range(n))


def test_reference_four_steps():
    sched = build_dp_schedule([100] * 256, 64, 4, 8)
    assert sched.num_steps == 4
    assert sched.num_microbatches == [2, 2, 2, 2]
    # step s only touches samples of step s
    for rank in range(4):
        for step in range(4):
            idx = [i for mb in sched.micro_batches[rank][step] for i in mb]
            assert all(step * 64 <= i < (step + 1) * 64 for i in idx)


def test_uneven_micro_batch_keeps_every_sample():
    sched = build_dp_schedule([1] * 12, 12, 2, 4)  # 6 per rank -> 4 + 2
    assert sched.num_microbatches == [2]
    assert [len(mb) for mb in sched.micro_batches[0][0]] == [4, 2]


def test_token_budget_packing_equal_counts_and_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(10, 400) for _ in range(128)]
    budget = 1024
    sched = build_dp_schedule(lengths, 64, 4, 8, max_tokens_per_gpu=budget)
    assert len(sched.num_microbatches) == 2
    seen = []
    for rank in range(4):
        for step in range(2):
            mbs = sched.micro_batches[rank][step]
            assert len(mbs) == sched.num_microbatches[step]
            assert all(mb for mb in mbs), "no empty micro-batches"
            for mb in mbs:
                assert sum(lengths[i] for i in mb) <= budget
            seen += [i for mb in mbs for i in mb]
        assert len(sched.partition(rank)) == 32
    assert sorted(seen) == list(range(128))
    # balanced: rank token totals of a step differ by less than the longest sample
    for step in range(2):
        totals = [sum(lengths[i] for mb in sched.micro_batches[r][step] for i in mb) for r in range(4)]
        assert max(totals) - min(totals) <= max(lengths)


def test_packing_pads_count_by_splitting():
    # rank 0 gets the two long samples (one bin each), rank 1 the short ones (one bin): rank 1
    # must be split so both ranks run the same number of micro-batches
    lengths = [90, 90, 5, 5, 5, 5]
    sched = build_dp_schedule(lengths, 6, 2, 8, max_tokens_per_gpu=100)
    counts = [len(sched.micro_batches[r][0]) for r in range(2)]
    assert counts[0] == counts[1] == sched.num_microbatches[0]
    assert sorted(sched.partition(0) + sched.partition(1)) == list(range(6))


def test_oversized_sample_gets_its_own_micro_batch():
    sched = build_dp_schedule([500, 10, 10, 10], 4, 1, 8, max_tokens_per_gpu=100)
    assert [500 in [[500, 10, 10, 10][i] for i in mb] for mb in sched.micro_batches[0][0]].count(True) == 1
    assert any(mb == [0] for mb in sched.micro_batches[0][0])


@pytest.mark.parametrize(
    "args, match",
    [
        (([1] * 10, 4, 2, 2), "not a positive multiple of global_batch_size=4"),
        (([1] * 6, 6, 4, 2), "not divisible by dp_size=4"),
        (([1] * 4, 4, 1, 0), "micro_batch_size=0"),
        (([], 4, 1, 1), "not a positive multiple"),
    ],
)
def test_bad_arguments_name_the_field(args, match):
    with pytest.raises(ValueError, match=match):
        build_dp_schedule(*args)


def test_partition_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 4"):
        build_dp_schedule([1] * 8, 8, 4, 2).partition(4)
