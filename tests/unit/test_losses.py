"""Policy losses, KL estimators, entropy, TIS and aggregation (the train phase's loss)."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.algo.advantages import normalize_group
from vime_core.algo.kl import compute_approx_kl
from vime_core.algo.losses import (
    PolicyLossParams,
    aggregate_loss,
    compute_cispo_loss,
    compute_policy_loss,
    entropy_from_logits,
    policy_loss_name,
    sequence_mean_kl,
    tis_weights,
)
from vime_core.algo.registry import get_policy_loss_fn

A = normalize_group([1, 0, 0, 1, 1, 0, 1, 0], True)[0]  # +0.9354


def test_ratio_one_loss_is_minus_advantage():
    advantages = torch.tensor([A, -A])
    loss, clipfrac = compute_policy_loss(torch.zeros(2), advantages, 0.2, 0.2)
    assert [round(x, 4) for x in loss.tolist()] == [-0.9354, 0.9354]
    assert clipfrac.tolist() == [0.0, 0.0]


def test_gradient_non_zero_with_detached_old_log_probs():
    log_probs = torch.tensor([-0.42, -1.10, -0.08], requires_grad=True)
    old = log_probs.detach()
    advantages = torch.full((3,), A)
    loss, _ = compute_policy_loss(old - log_probs, advantages, 0.2, 0.2)
    loss.mean().backward()
    # d/dlogp of -exp(logp - old) * A at ratio 1 = -A, averaged over 3 tokens
    assert log_probs.grad.tolist() == pytest.approx([-A / 3] * 3)


def test_ratio_above_upper_clip_with_positive_advantage_has_zero_gradient():
    eps, eps_high = 0.2, 0.28
    log_probs = torch.tensor([0.5], requires_grad=True)  # ratio e^0.5 = 1.65 > 1.28
    old = torch.tensor([0.0])
    loss, clipfrac = compute_policy_loss(old - log_probs, torch.tensor([1.0]), eps, eps_high)
    loss.sum().backward()
    assert loss.item() == pytest.approx(-(1 + eps_high))
    assert clipfrac.item() == 1.0
    assert log_probs.grad.item() == 0.0


def test_ratio_below_lower_clip_with_negative_advantage_is_clipped():
    log_probs = torch.tensor([math.log(0.5)], requires_grad=True)
    loss, clipfrac = compute_policy_loss(-log_probs, torch.tensor([-1.0]), 0.2, 0.2)
    loss.sum().backward()
    assert loss.item() == pytest.approx(0.8)
    assert clipfrac.item() == 1.0 and log_probs.grad.item() == 0.0


def test_dual_clip_bounds_negative_advantage_loss():
    c = 3.0
    log_probs = torch.tensor([math.log(5.0), math.log(2.0)], requires_grad=True)  # ratios 5 and 2
    advantages = torch.tensor([-1.0, -1.0])
    plain, _ = compute_policy_loss(-log_probs.detach(), advantages, 0.2, 0.2)
    assert plain.tolist() == pytest.approx([5.0, 2.0])
    loss, _ = compute_policy_loss(-log_probs, advantages, 0.2, 0.2, eps_clip_c=c)
    assert loss.tolist() == pytest.approx([c * 1.0, 2.0])
    loss.sum().backward()
    assert log_probs.grad[0].item() == 0.0 and log_probs.grad[1].item() != 0.0
    # positive advantages are untouched by the dual clip
    pos, _ = compute_policy_loss(torch.tensor([-0.1]), torch.tensor([1.0]), 0.2, 0.2, eps_clip_c=c)
    ref, _ = compute_policy_loss(torch.tensor([-0.1]), torch.tensor([1.0]), 0.2, 0.2)
    assert pos.item() == ref.item()
    with pytest.raises(ValueError, match="eps_clip_c"):
        compute_policy_loss(torch.zeros(1), torch.ones(1), 0.2, 0.2, eps_clip_c=1.0)


def test_gspo_uses_masked_sequence_mean_ratio():
    ppo_kl = torch.tensor([0.1, 0.3, 9.0, -0.2])
    mask = torch.tensor([1, 1, 0, 1])
    out = sequence_mean_kl(ppo_kl, mask, [3, 1])
    assert out.tolist() == pytest.approx([0.2, 0.2, 0.2, -0.2])
    log_probs = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    old = torch.tensor([-1.1, -1.9, -3.0])
    fn = get_policy_loss_fn(policy_loss_name("gspo"))
    loss, _ = fn(log_probs, old, torch.ones(3), torch.ones(3), [3], PolicyLossParams(0.2, 0.2))
    seq_ratio = math.exp((log_probs.detach() - old).mean().item())
    assert loss.tolist() == pytest.approx([-seq_ratio] * 3)


def test_cispo_weight_is_clipped_and_detached():
    log_probs = torch.tensor([math.log(2.0), math.log(0.5)], requires_grad=True)
    old = torch.zeros(2)
    loss, clipfrac = compute_cispo_loss(old - log_probs, log_probs, torch.tensor([1.0, 1.0]), 0.28)
    assert clipfrac.tolist() == [1.0, 0.0]
    loss.sum().backward()
    assert log_probs.grad.tolist() == pytest.approx([-1.28, -0.5])


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    lr = logp - ref
    assert compute_approx_kl(logp, ref, "k1").tolist() == pytest.approx(lr.tolist())
    assert compute_approx_kl(logp, ref, "k2").tolist() == pytest.approx((0.5 * lr**2).tolist())
    k3 = torch.exp(-lr) - 1 + lr
    assert compute_approx_kl(logp, ref, "k3").tolist() == pytest.approx(k3.tolist())
    assert min(k3.tolist()) >= 0
    big = compute_approx_kl(torch.tensor([-30.0]), torch.tensor([0.0]), "low_var_kl")
    assert big.item() == 10.0
    with pytest.raises(ValueError, match="kl_loss_type 'k9'"):
        compute_approx_kl(logp, ref, "k9")


def test_entropy_from_logits():
    uniform = torch.zeros(2, 7)
    assert entropy_from_logits(uniform).tolist() == pytest.approx([math.log(7)] * 2)
    peaked = torch.tensor([[100.0, 0.0, 0.0]])
    assert entropy_from_logits(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_tis_weights_clip_and_detach():
    old = torch.tensor([0.0, 0.0], requires_grad=True)
    w = tis_weights(old, torch.tensor([-2.0, 0.1]), tis_clip=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(-0.1)])
    assert not w.requires_grad


def test_aggregation_modes_only_count_masked_tokens():
    loss = torch.tensor([1.0, 2.0, 100.0, 4.0])
    mask = torch.tensor([1, 1, 0, 1])
    lengths = [3, 1]
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean", lengths).item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate_loss(loss, mask, "seq_mean_token_sum", lengths).item() == pytest.approx((3.0 + 4.0) / 2)
    padded = torch.tensor([[1.0, 2.0, 100.0], [4.0, 50.0, 60.0]])
    pmask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_loss(padded, pmask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    # a sequence without a trainable token is left out of the mean over sequences
    skipped = torch.tensor([1.0, 2.0, 100.0, 4.0, 7.0, 9.0])
    assert aggregate_loss(
        skipped, torch.tensor([1, 1, 0, 1, 0, 0]), "seq_mean_token_mean", [3, 1, 2]
    ).item() == pytest.approx((1.5 + 4.0) / 2)
    with pytest.raises(ValueError, match="needs response_lengths"):
        aggregate_loss(loss, mask, "seq_mean_token_sum")
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        aggregate_loss(loss, mask, "bogus")


def test_fully_masked_batch_aggregates_to_zero_with_graph():
    x = torch.ones(3, requires_grad=True)
    out = aggregate_loss(x * 2, torch.zeros(3), "seq_mean_token_mean", [3])
    assert out.item() == 0.0 and out.requires_grad


def test_unknown_policy_loss_is_a_clear_error():
    with pytest.raises(KeyError, match="unknown policy loss 'x'"):
        get_policy_loss_fn("x")
