"""Every KL form is bounded and a token with loss mask 0 cannot poison the loss or its gradient
(vime_core/algo/kl.py, the policy losses' ppo_kl in vime_core/algo/losses.py)."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.algo import get_policy_loss_fn
from vime_core.algo.kl import KL_TYPES, LOG_RATIO_BOUND, LOW_VAR_KL_BOUND, compute_approx_kl, masked_log_ratio
from vime_core.algo.losses import LOSS_AGG_MODES, PolicyLossParams, aggregate_loss


def test_k3_and_low_var_kl_clamp_the_log_ratio_before_exp():
    """A log-ratio of -91 alone: exp(91) overflows fp32. k3 is taken at the bound (-20), its value
    and gradient finite; low_var_kl then cuts it to 10. Inside the bound both are plain k3."""
    log_p = torch.tensor([-91.5, -1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-0.5, -1.5, -1.0])
    assert math.isinf(torch.exp(torch.tensor(91.0)).item())  # what the clamp avoids
    s = -LOG_RATIO_BOUND
    k3 = compute_approx_kl(log_p, ref, "k3")
    assert k3[0].item() == pytest.approx(math.exp(-s) - 1 + s, rel=1e-6)
    inside = (log_p.detach() - ref)[1:]
    assert k3[1:].tolist() == pytest.approx((torch.exp(-inside) - 1 + inside).tolist())
    low = compute_approx_kl(log_p, ref, "low_var_kl")
    assert low[0].item() == LOW_VAR_KL_BOUND and low[1:].tolist() == pytest.approx(k3[1:].tolist())
    for kl_type in ("k3", "low_var_kl"):
        log_p.grad = None
        compute_approx_kl(log_p, ref, kl_type).sum().backward()
        assert torch.isfinite(log_p.grad).all(), (kl_type, log_p.grad)
        assert log_p.grad[0].item() == 0.0  # beyond the bound the estimate is flat
        assert log_p.grad[1:].tolist() == pytest.approx((1 - torch.exp(-inside)).tolist())


@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_a_masked_token_gets_exactly_zero_kl_and_no_gradient(kl_type):
    log_p = torch.tensor([-1.0, -91.5, float("nan"), -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -0.5, -0.5, -1.0])
    mask = torch.tensor([1.0, 0.0, 0.0, 1.0])
    kl = compute_approx_kl(log_p, ref, kl_type, mask)
    assert kl[1].item() == 0.0 and kl[2].item() == 0.0  # a NaN there stays out too
    unmasked = compute_approx_kl(log_p.detach()[[0, 3]], ref[[0, 3]], kl_type)
    assert kl[[0, 3]].tolist() == pytest.approx(unmasked.tolist())
    kl.sum().backward()
    assert log_p.grad[1].item() == 0.0 and log_p.grad[2].item() == 0.0
    assert torch.isfinite(log_p.grad).all()
    assert masked_log_ratio(log_p, ref, mask)[1:3].tolist() == [0.0, 0.0]


def _loss(log_probs, old, ref, advantages, mask, lengths, policy_loss, kl_type, mode):
    """A micro-batch's L = agg(pg) + kl_loss_coef * agg(kl), as train_step.micro_batch_loss builds it."""
    per_token, _ = get_policy_loss_fn(policy_loss)(log_probs, old, advantages, mask, lengths, PolicyLossParams())
    kl = compute_approx_kl(log_probs, ref, kl_type, mask)
    return aggregate_loss(per_token, mask, mode, lengths, 8.0) + 0.1 * aggregate_loss(kl, mask, mode, lengths, 8.0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_a_masked_token_with_log_ratio_minus_91_leaves_the_loss_and_gradient_as_without_it(policy_loss, kl_type, mode):
    """Two samples [3, 2 tokens]; the second token of the first one has loss mask 0 and a
    log-ratio of -91 to the reference (a tool output the reference finds impossible). The loss
    and the gradient are finite and equal those of the same micro-batch without that token; the
    token itself gets a gradient of exactly 0."""
    torch.manual_seed(0)
    lengths = [3, 2]
    current = torch.tensor([-1.2, -91.5, -0.7, -2.0, -0.4])
    old = current + 0.05 * torch.randn(5)
    old[1] = current[1]
    ref = current - 0.1 * torch.randn(5).abs()
    ref[1] = -0.5  # log p - log p_ref = -91
    advantages = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])

    with_token = current.clone().requires_grad_(True)
    loss = _loss(with_token, old, ref, advantages, mask, lengths, policy_loss, kl_type, mode)
    loss.backward()

    keep = [0, 2, 3, 4]
    without = current[keep].clone().requires_grad_(True)
    expected = _loss(without, old[keep], ref[keep], advantages[keep], mask[keep], [2, 2], policy_loss, kl_type, mode)
    expected.backward()

    assert math.isfinite(loss.item()) and torch.isfinite(with_token.grad).all(), with_token.grad
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    assert with_token.grad[keep].tolist() == pytest.approx(without.grad.tolist(), rel=1e-6, abs=1e-7)
    assert with_token.grad[1].item() == 0.0


@pytest.mark.parametrize("policy_loss", ["ppo", "gspo", "cispo"])
def test_a_masked_token_whose_ratio_to_the_old_policy_overflows_stays_out(policy_loss):
    """The same for the policy ratio: a masked token with log pi - log pi_old = +91 (exp
    overflows) adds nothing, its ppo_kl is 0 by torch.where."""
    lengths = [3]
    log_probs = torch.tensor([-1.0, -0.5, -2.0], requires_grad=True)
    old = torch.tensor([-1.1, -91.5, -1.9])
    advantages = torch.tensor([-1.0, -1.0, -1.0])
    mask = torch.tensor([1.0, 0.0, 1.0])
    per_token, clipfrac = get_policy_loss_fn(policy_loss)(log_probs, old, advantages, mask, lengths, PolicyLossParams())
    loss = aggregate_loss(per_token, mask, "token_mean")
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(log_probs.grad).all(), log_probs.grad
    assert log_probs.grad[1].item() == 0.0 and clipfrac[1].item() == 0.0


def test_the_ppo_ratio_of_an_unmasked_token_is_bounded():
    """exp(clamp(-ppo_kl, -20, 20)), as verl: a real token 91 nats above its old log-prob gives a
    finite loss and gradient (the dual clip's bound aside)."""
    log_probs = torch.tensor([-0.5], requires_grad=True)
    per_token, _ = get_policy_loss_fn("ppo")(
        log_probs, torch.tensor([-91.5]), torch.tensor([-1.0]), torch.ones(1), [1], PolicyLossParams()
    )
    assert per_token.item() == pytest.approx(math.exp(20.0), rel=1e-6)
    per_token.sum().backward()
    assert torch.isfinite(log_probs.grad).all()
