"""The critic's clipped value loss and explained variance (vime_core/algo/value_loss.py), against
numbers worked out by hand in the test."""

from __future__ import annotations

import statistics

import pytest
import torch

from vime_core.algo.losses import aggregate_loss
from vime_core.algo.value_loss import clipped_value_loss, explained_variance_from_moments


def test_clipped_value_loss_takes_the_larger_of_the_two_squared_errors():
    # eps = 0.2, per token (V, V_old, R):
    #   (1.0, 0.5, 0.0): V moved +0.5 -> V_clip = 0.7; (V-R)^2 = 1.00, (V_clip-R)^2 = 0.49 -> 0.5*1.00, not clipped
    #   (1.0, 0.5, 2.0): (V-R)^2 = 1.00, V_clip = 0.7, (0.7-2)^2 = 1.69 -> 0.5*1.69, clipped
    #   (0.1, 0.0, 0.1): inside the clip: V_clip = V -> both 0, not clipped
    #   (-1.0, 0.0, -1.0): V moved -1.0 -> V_clip = -0.2; (V-R)^2 = 0, (-0.2+1)^2 = 0.64 -> 0.5*0.64, clipped
    values = torch.tensor([1.0, 1.0, 0.1, -1.0], requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.0, 0.0])
    returns = torch.tensor([0.0, 2.0, 0.1, -1.0])
    loss, clipfrac = clipped_value_loss(values, old, returns, value_clip=0.2)
    assert loss.tolist() == pytest.approx([0.5, 0.845, 0.0, 0.32])
    assert clipfrac.tolist() == [0.0, 1.0, 0.0, 1.0]
    # the clipped terms carry no gradient into V (the clip saturates): only token 0's (V - R) does
    loss.sum().backward()
    assert values.grad.tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])


def test_the_masked_token_mean_is_the_step_loss():
    values = torch.tensor([0.3, -0.4, 2.0, 0.0])
    old = torch.tensor([0.2, -0.5, 1.0, 0.1])
    returns = torch.tensor([1.0, 1.0, 1.0, 5.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last token is not trained on
    loss, _ = clipped_value_loss(values, old, returns, value_clip=0.5)
    # token 0: V=0.3 inside the clip of 0.2 -> 0.5*0.49; token 1: inside -> 0.5*1.96;
    # token 2: V_clip = 1.5, max(1.0, 0.25) = 1.0 -> 0.5; mean over the 3 masked tokens
    expected = (0.5 * 0.49 + 0.5 * 1.96 + 0.5) / 3
    assert float(aggregate_loss(loss, mask, "token_mean")) == pytest.approx(expected)


def test_explained_variance_from_the_token_moments():
    returns = [1.0, 0.0, 2.0, 1.0, 0.5]
    values = [0.8, 0.1, 1.5, 1.2, 0.5]
    diffs = [r - v for r, v in zip(returns, values)]
    mean = statistics.fmean
    ev = explained_variance_from_moments(
        mean(returns), mean([r * r for r in returns]), mean(diffs), mean([d * d for d in diffs])
    )
    assert ev == pytest.approx(1 - statistics.pvariance(diffs) / statistics.pvariance(returns))
    perfect = explained_variance_from_moments(mean(returns), mean([r * r for r in returns]), 0.0, 0.0)
    assert perfect == pytest.approx(1.0)
    # the mean as the prediction explains nothing
    mean_only = [r - mean(returns) for r in returns]
    assert explained_variance_from_moments(
        mean(returns), mean([r * r for r in returns]), mean(mean_only), mean([d * d for d in mean_only])
    ) == pytest.approx(0.0, abs=1e-12)
    assert explained_variance_from_moments(1.0, 1.0, 0.0, 0.0) is None  # constant returns: undefined
