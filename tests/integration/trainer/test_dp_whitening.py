"""Whitening over the whole step on every DP layout: the advantages (and the critic's returns) that
train_on_rollout hands each step at DP=2, two processes over gloo, equal DP=1's within fp32
tolerance (tests/integration/trainer/dp_advantages.py holds the batch and the stand-ins)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.dp_advantages import (
    ESTIMATORS,
    FLAT_GROUPS,
    PER_GROUP,
    TOOL_SAMPLES,
    dump_rank_advantages,
    rank_advantages,
)

# Same float64 sums in a different order, rounded to float32 at the end.
ATOL = 1e-6


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    """{rank: {estimator: {"advantages", "returns"}}} of the DP=2 run."""
    out = tmp_path_factory.mktemp("dp2")
    spawn(dump_rank_advantages, 2, str(out))
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)}


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_dp2_advantages_equal_dp1(dp2, estimator):
    whole = rank_advantages(estimator, dp_size=1, dp_rank=0)
    n = len(whole["advantages"])
    ours = {**dp2[0][estimator]["advantages"], **dp2[1][estimator]["advantages"]}
    assert sorted(ours) == list(range(n))
    for i in range(n):
        torch.testing.assert_close(ours[i], whole["advantages"][i], atol=ATOL, rtol=0, msg=f"sample {i}")
    if estimator == "ppo":  # what the critic trains on
        returns = {**dp2[0][estimator]["returns"], **dp2[1][estimator]["returns"]}
        for i in range(n):
            torch.testing.assert_close(returns[i], whole["returns"][i], atol=ATOL, rtol=0, msg=f"sample {i}")
    for i in TOOL_SAMPLES:  # a tool span's advantages are 0 (it carries no loss)
        assert ours[i][-5:-2].tolist() == [0.0, 0.0, 0.0]


def test_the_rank_of_flat_groups_does_not_whiten_kl_noise_to_order_one(dp2):
    """The issue's case: rank 0 holds only flat groups, whose centred rewards are 0; whitened over
    the rank they read |A| ~ 1 of KL noise, over the step they stay at the noise's size."""
    rank0 = dp2[0]["reinforce_plus_plus_baseline"]["advantages"]
    assert {i // PER_GROUP for i in rank0} <= FLAT_GROUPS
    assert max(a.abs().max().item() for a in rank0.values()) < 0.05
