"""Per-token advantages on a multi-turn layout: the KL penalty, the reward and the recursions live on
the model tokens (loss_mask 1) only; tool tokens get 0 (vime_core/algo/advantages.py's docstring).

The expected numbers come from a reference written here from the closed forms, not the recursions
the code runs: G_{t_k} = sum_{j >= k} gamma^(j - k) r_{t_j} and GAE's
D_k = sum_{j >= k} (gamma lambd)^(j - k) delta_j, over the model tokens t_1 < ... < t_K.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from vime_core.algo.advantages import compute_advantages
from vime_core.config import load_config

# The issue's sample: [2 model, 3 tool, 2 model] tokens, reward 1. Under use_rollout_logprobs a
# tool token's log-prob is the placeholder 0.0 (rollout/multi_turn.py), so its k1 KL is -log p_ref.
TOOL_MASK = [1, 1, 0, 0, 0, 1, 1]
POLICY = [-0.5, -1.2, 0.0, 0.0, 0.0, -0.3, -0.8]
REFERENCE = [-0.6, -1.0, -9.0, -8.0, -7.0, -0.2, -1.1]
# a second, single-turn sample of the step, so that the whitening has something to spread over
PLAIN_MASK = [1, 1, 1]
PLAIN_POLICY = [-0.4, -0.9, -2.0]
PLAIN_REFERENCE = [-0.5, -0.7, -1.5]
KL_COEF = 0.1


def _k1(policy, reference):
    return [p - r for p, r in zip(policy, reference)]


STEP = {  # rewards, masks, KL (k1 of pi_old against the reference), values
    "rewards": [1.0, 0.0],
    "masks": [TOOL_MASK, PLAIN_MASK],
    "kl": [_k1(POLICY, REFERENCE), _k1(PLAIN_POLICY, PLAIN_REFERENCE)],
    "values": [[0.3, 0.1, 5.0, -4.0, 7.0, 0.6, 0.2], [0.05, -0.2, 0.4]],
}


def _model(mask):
    return [t for t, m in enumerate(mask) if m == 1]


def _token_rewards(reward, kl, mask):
    """r_t = -kl_coef kl_t on model tokens, + reward at the last model token."""
    model = _model(mask)
    r = {t: -KL_COEF * kl[t] for t in model}
    r[model[-1]] += reward
    return r


def _reference_returns(reward, kl, mask, gamma):
    model = _model(mask)
    r = _token_rewards(reward, kl, mask)
    out = [0.0] * len(mask)
    for k, t in enumerate(model):
        out[t] = sum(gamma ** (j - k) * r[model[j]] for j in range(k, len(model)))
    return out


def _reference_gae(reward, kl, mask, values, gamma, lambd):
    model = _model(mask)
    r = _token_rewards(reward, kl, mask)
    v = [values[t] for t in model] + [0.0]
    delta = [r[t] + gamma * v[k + 1] - v[k] for k, t in enumerate(model)]
    adv, ret = [0.0] * len(mask), [0.0] * len(mask)
    for k, t in enumerate(model):
        adv[t] = sum((gamma * lambd) ** (j - k) * delta[j] for j in range(k, len(model)))
        ret[t] = adv[t] + values[t]
    return adv, ret


def _reference_whiten(per_sample, masks):
    """(x - mean) / sqrt(var + 1e-8) over the model tokens of every sample, unbiased var; 0 elsewhere."""
    model_values = [x for xs, m in zip(per_sample, masks) for x, mt in zip(xs, m) if mt == 1]
    mean, var = statistics.fmean(model_values), statistics.variance(model_values)
    return [
        [(x - mean) / math.sqrt(var + 1e-8) if mt == 1 else 0.0 for x, mt in zip(xs, m)]
        for xs, m in zip(per_sample, masks)
    ]


def _run(estimator, values=STEP["values"], **kwargs):
    kl = [torch.tensor(k) for k in STEP["kl"]]
    values = [torch.tensor(v) for v in values]
    advantages, returns = compute_advantages(
        estimator, STEP["rewards"], STEP["masks"], kl=kl, values=values, kl_coef=KL_COEF, **kwargs
    )
    return [a.tolist() for a in advantages], [g.tolist() for g in returns]


def _assert_close(ours, expected):
    for o, e in zip(ours, expected, strict=True):
        assert o == pytest.approx(e, abs=1e-5)


def test_the_issues_sample_gets_its_reward_undiminished_by_tool_tokens():
    """The issue's reproduction: KL 0 on the model tokens, -log p_ref on the tool tokens; the
    returns were [-1.4, -1.4, -1.4, -0.5, 0.3, 1.0, 1.0]. Now every model token returns the reward."""
    kl = _k1([-0.5, -1.2, 0.0, 0.0, 0.0, -0.3, -0.8], [-0.5, -1.2, -9.0, -8.0, -7.0, -0.3, -0.8])
    _, returns = compute_advantages(
        "reinforce_plus_plus", [1.0], [TOOL_MASK], kl=[torch.tensor(kl)], kl_coef=KL_COEF, gamma=1.0
    )
    assert returns[0].tolist() == pytest.approx(_reference_returns(1.0, kl, TOOL_MASK, 1.0))
    assert [returns[0][t].item() for t in _model(TOOL_MASK)] == pytest.approx([1.0] * 4)


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_returns_and_advantages_match_the_reference(gamma):
    advantages, returns = _run("reinforce_plus_plus", gamma=gamma)
    expected = [_reference_returns(r, k, m, gamma) for r, k, m in zip(STEP["rewards"], STEP["kl"], STEP["masks"])]
    _assert_close(returns, expected)
    _assert_close(advantages, _reference_whiten(expected, STEP["masks"]))


def test_reinforce_plus_plus_baseline_takes_the_kl_of_model_tokens_only():
    advantages, returns = _run("reinforce_plus_plus_baseline")
    raw = [
        [a - KL_COEF * k if mt == 1 else 0.0 for k, mt in zip(kl, m)]
        for a, kl, m in zip(STEP["rewards"], STEP["kl"], STEP["masks"])
    ]
    _assert_close(advantages, _reference_whiten(raw, STEP["masks"]))
    assert returns == advantages


def test_gae_runs_over_model_tokens_and_never_reads_a_tool_tokens_value():
    gamma, lambd = 0.9, 0.8
    advantages, returns = _run("ppo", gamma=gamma, lambd=lambd)
    expected = [
        _reference_gae(r, k, m, v, gamma, lambd)
        for r, k, m, v in zip(STEP["rewards"], STEP["kl"], STEP["masks"], STEP["values"])
    ]
    _assert_close(returns, [g for _, g in expected])
    _assert_close(advantages, _reference_whiten([a for a, _ in expected], STEP["masks"]))
    # the critic never trains on a tool token's value: changing it changes nothing
    other = [[v if m == 1 else 1e3 for v, m in zip(vs, mask)] for vs, mask in zip(STEP["values"], STEP["masks"])]
    assert _run("ppo", values=other, gamma=gamma, lambd=lambd) == (advantages, returns)


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"])
def test_a_non_finite_kl_on_a_tool_token_does_not_travel(estimator):
    finite = _run(estimator, gamma=0.9, lambd=0.8)
    kl = [torch.tensor(k) for k in STEP["kl"]]
    kl[0][2], kl[0][3] = float("inf"), float("nan")
    values = [torch.tensor(v) for v in STEP["values"]]
    advantages, returns = compute_advantages(
        estimator, STEP["rewards"], STEP["masks"], kl=kl, values=values, kl_coef=KL_COEF, gamma=0.9, lambd=0.8
    )
    assert ([a.tolist() for a in advantages], [g.tolist() for g in returns]) == finite


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "ppo"])
def test_a_sample_without_model_tokens_gets_zeros_and_leaves_the_others_alone(estimator):
    """A failed sample (loss mask all 0) carries no reward, no KL and no weight in the whitening."""
    kl = [torch.tensor(k) for k in STEP["kl"]]
    values = [torch.tensor(v) for v in STEP["values"]]
    alone = compute_advantages(estimator, STEP["rewards"], STEP["masks"], kl=kl, values=values, kl_coef=KL_COEF)
    failed = compute_advantages(
        estimator,
        STEP["rewards"] + [1.0],
        STEP["masks"] + [[0, 0]],
        kl=kl + [torch.tensor([3.0, 4.0])],
        values=values + [torch.tensor([1.0, 2.0])],
        kl_coef=KL_COEF,
    )
    for ours, before in zip(failed, alone):
        assert [x.tolist() for x in ours[:2]] == [x.tolist() for x in before]
        assert ours[2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_step_advantages_under_use_rollout_logprobs_ignore_the_tool_tokens_placeholder(estimator):
    """Through the trainer's step_advantages: pi_old is the engine's log-probs, 0.0 on tool tokens;
    the reference log-probs of tool tokens, whatever they are, change nothing."""
    from vime_core.trainer.rollout_training import step_advantages

    cfg = load_config(
        overrides={
            "advantage_estimator": estimator,
            "kl_coef": KL_COEF,
            "kl_loss_type": "k1",
            "use_rollout_logprobs": True,
            "gamma": 0.9,
            "n_samples_per_prompt": 2,
        }
    )
    batch = {
        "advantage": STEP["rewards"],
        "loss_mask": STEP["masks"],
        "rollout_log_probs": [POLICY, PLAIN_POLICY],
        "response_length": [len(POLICY), len(PLAIN_POLICY)],
    }
    ref = {0: torch.tensor(REFERENCE), 1: torch.tensor(PLAIN_REFERENCE)}
    advantages, _ = step_advantages(cfg, batch, [0, 1], None, ref)
    expected, _ = _run(estimator, gamma=0.9)
    _assert_close([advantages[0].tolist(), advantages[1].tolist()], expected)
    other_ref = {0: torch.tensor([r if m == 1 else -50.0 for r, m in zip(REFERENCE, TOOL_MASK)]), 1: ref[1]}
    again, _ = step_advantages(cfg, batch, [0, 1], None, other_ref)
    assert all(torch.equal(again[i], advantages[i]) for i in (0, 1))
