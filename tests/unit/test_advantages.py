"""Group normalisation (the build phase) and per-token advantages (the train phase)."""

from __future__ import annotations

import statistics

import pytest
import torch

from vime_core.algo.advantages import (
    compute_advantages,
    discounted_returns,
    gae,
    masked_whiten,
    normalize_group,
    postprocess_rewards,
)
from vime_core.algo.registry import get_adv_estimator_fn, register_adv_est

REFERENCE_GROUP = [1, 0, 0, 1, 1, 0, 1, 0]


def test_reference_group_normalises_to_pm_0_9354():
    mean = statistics.mean(REFERENCE_GROUP)
    std = statistics.stdev(REFERENCE_GROUP)  # unbiased (n - 1)
    assert mean == pytest.approx(0.5)
    assert round(std, 4) == 0.5345
    out = normalize_group(REFERENCE_GROUP, std_normalization=True)
    expected = [(r - mean) / (std + 1e-6) for r in REFERENCE_GROUP]
    assert out == pytest.approx(expected, abs=1e-9)
    assert [round(x, 4) for x in out] == [0.9354, -0.9354, -0.9354, 0.9354, 0.9354, -0.9354, 0.9354, -0.9354]


def test_all_ones_group_gives_zeros():
    assert normalize_group([1.0] * 8, std_normalization=True) == [0.0] * 8


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo"])
def test_std_normalisation_for_group_estimators(estimator):
    rewards = REFERENCE_GROUP + [0, 0, 1, 1]
    groups = [0] * 8 + [1] * 4
    out = postprocess_rewards(rewards, groups, estimator, grpo_std_normalization=True)
    second = [0, 0, 1, 1]
    expected_second = [(r - 0.5) / (statistics.stdev(second) + 1e-6) for r in second]
    assert out[8:] == pytest.approx(expected_second)
    assert out[:8] == pytest.approx(normalize_group(REFERENCE_GROUP, True))


def test_without_std_normalisation_only_centres():
    out = postprocess_rewards(REFERENCE_GROUP, [0] * 8, "grpo", grpo_std_normalization=False)
    assert out == pytest.approx([r - 0.5 for r in REFERENCE_GROUP])


def test_single_sample_group_is_not_divided():
    assert postprocess_rewards([3.0], [7], "grpo") == [0.0]


def test_baseline_centres_only_and_reinforce_keeps_raw():
    rewards = [2.0, 0.0, 1.0, 5.0]
    groups = [0, 1, 0, 1]  # non-contiguous groups
    assert postprocess_rewards(rewards, groups, "reinforce_plus_plus_baseline") == pytest.approx([0.5, -2.5, -0.5, 2.5])
    assert postprocess_rewards(rewards, groups, "reinforce_plus_plus") == rewards
    with pytest.raises(ValueError, match="2 group ids"):
        postprocess_rewards(rewards, [0, 1], "grpo")


def test_grpo_broadcasts_reference_advantage_over_response_tokens():
    a0 = normalize_group(REFERENCE_GROUP, True)[0]
    advantages, returns = compute_advantages("grpo", [a0, -a0], [[1, 1, 1], [1, 0]])
    assert [round(x, 4) for x in advantages[0].tolist()] == [0.9354] * 3
    assert advantages[1].tolist() == pytest.approx([-a0, -a0])
    assert returns[0] is advantages[0]


def test_discounted_returns_and_reinforce_plus_plus_whitening():
    r = torch.tensor([0.0, 0.0, 1.0])
    assert discounted_returns(r, 0.5).tolist() == pytest.approx([0.25, 0.5, 1.0])
    advantages, returns = compute_advantages("reinforce_plus_plus", [1.0, 0.0], [[1, 1, 1], [1, 1]], gamma=0.5)
    assert returns[0].tolist() == pytest.approx([0.25, 0.5, 1.0])
    assert returns[1].tolist() == pytest.approx([0.0, 0.0])
    flat = torch.cat(returns)
    expected = (flat - flat.mean()) / torch.sqrt(flat.var(unbiased=True) + 1e-8)
    assert torch.cat(advantages).tolist() == pytest.approx(expected.tolist(), abs=1e-6)


def test_kl_penalty_enters_reinforce_token_rewards():
    kl = [torch.tensor([0.1, 0.2])]
    _, returns = compute_advantages("reinforce_plus_plus", [1.0], [[1, 1]], kl=kl, kl_coef=0.5, gamma=1.0)
    assert returns[0].tolist() == pytest.approx([-0.05 + -0.1 + 1.0, -0.1 + 1.0])


def test_whitening_ignores_masked_tokens():
    values = [torch.tensor([1.0, 2.0, 100.0]), torch.tensor([3.0])]
    masks = [torch.tensor([1, 1, 0]), torch.tensor([1])]
    out = torch.cat(masked_whiten(values, masks))
    valid = out[torch.tensor([0, 1, 3])]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert valid.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-4)


def test_baseline_estimator_subtracts_kl_then_whitens():
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", [0.5, -0.5], [[1, 1], [1, 1]])
    assert torch.cat(adv).mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[0][0].item() > 0 > adv[1][0].item()


def test_gae_matches_recursion_and_lambda_one_is_monte_carlo():
    rewards = torch.tensor([0.0, 0.0, 1.0])
    values = torch.tensor([0.2, 0.4, 0.6])
    gamma, lambd = 0.9, 0.8
    adv, ret = gae(rewards, values, gamma, lambd)
    d2 = 1.0 - 0.6
    d1 = 0.0 + gamma * 0.6 - 0.4
    d0 = 0.0 + gamma * 0.4 - 0.2
    a2 = d2
    a1 = d1 + gamma * lambd * a2
    a0 = d0 + gamma * lambd * a1
    assert adv.tolist() == pytest.approx([a0, a1, a2])
    assert ret.tolist() == pytest.approx((adv + values).tolist())
    _, ret_mc = gae(rewards, values, gamma, 1.0)
    assert ret_mc.tolist() == pytest.approx(discounted_returns(rewards, gamma).tolist())


def test_ppo_needs_values():
    with pytest.raises(ValueError, match="values"):
        compute_advantages("ppo", [1.0], [[1]])
    adv, ret = compute_advantages("ppo", [1.0, 0.0], [[1, 1], [1]], values=[torch.zeros(2), torch.zeros(1)])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0])


def test_length_mismatch_names_the_input():
    with pytest.raises(ValueError, match="kl has 1 tokens"):
        compute_advantages("reinforce_plus_plus", [1.0], [[1, 1]], kl=[torch.zeros(1)])


def test_registry_unknown_and_duplicate_names():
    with pytest.raises(KeyError, match="unknown advantage estimator 'nope'.*grpo"):
        get_adv_estimator_fn("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_adv_est("grpo")(lambda *a, **k: None)


# ---- RLOO ----------------------------------------------------------------------------------------

RLOO_REWARDS = [1.0, 0.0, 0.5, 3.0, 1.0, -2.0, 0.0, 4.0]
RLOO_GROUPS = [0, 1, 0, 1, 0, 2, 1, 0]  # groups of 4, 3 and 1, interleaved


def _rloo_reference(rewards, groups):
    """A_i = r_i - (mean of the other rewards of i's group), by explicit loops; 0 alone."""
    out = []
    for i, (r_i, g_i) in enumerate(zip(rewards, groups)):
        others = [r_j for j, (r_j, g_j) in enumerate(zip(rewards, groups)) if g_j == g_i and j != i]
        if not others:
            out.append(0.0)
            continue
        baseline = 0.0
        for r_j in others:
            baseline += r_j / len(others)
        out.append(r_i - baseline)
    return out


def test_rloo_leave_one_out_baseline_matches_reference():
    out = postprocess_rewards(RLOO_REWARDS, RLOO_GROUPS, "rloo")
    assert out == pytest.approx(_rloo_reference(RLOO_REWARDS, RLOO_GROUPS), abs=1e-12)
    # by hand: group 0 = [1, 0.5, 1, 4]; sample 0's baseline (0.5 + 1 + 4) / 3 = 11/6
    assert out[0] == pytest.approx(1 - 11 / 6)
    assert out[5] == 0.0  # a group of one has no other sample
    # verl's form of the same estimator: n/(n-1) * r_i - n/(n-1) * mean_g(r)
    group0 = [1.0, 0.5, 1.0, 4.0]
    n, mean = len(group0), statistics.fmean(group0)
    assert [out[p] for p in (0, 2, 4, 7)] == pytest.approx([r * n / (n - 1) - mean * n / (n - 1) for r in group0])
    # the std switch is GRPO's: it does not change RLOO
    assert postprocess_rewards(RLOO_REWARDS, RLOO_GROUPS, "rloo", grpo_std_normalization=False) == out


def test_rloo_broadcasts_its_advantage_and_trains_with_ppo_clip():
    from vime_core.algo.losses import policy_loss_name
    from vime_core.algo.registry import get_adv_estimator

    advantages, returns = compute_advantages("rloo", [0.75, -0.25], [[1, 1, 0], [1]])
    assert advantages[0].tolist() == [0.75] * 3 and advantages[1].tolist() == [-0.25]
    assert returns[0] is advantages[0]
    assert policy_loss_name("rloo") == "ppo"
    assert get_adv_estimator("rloo").token_rewards is False  # kl_coef refused; use_kl_loss is the KL term


def test_rloo_in_the_batch_and_the_configuration():
    from vime_core.config import parse_args
    from vime_core.data.batch import build_batch
    from vime_core.data.sample import Sample, Status

    from vime_core.config import VimeConfig

    cfg = parse_args(["--advantage-estimator", "rloo", "--n-samples-per-prompt", "4", "--rollout-batch-size", "2"])
    assert cfg.advantage_estimator == "rloo"
    assert "rloo" in VimeConfig.model_json_schema()["properties"]["advantage_estimator"]["enum"]  # the Prefect form
    samples = []
    for i, (reward, group) in enumerate(zip(RLOO_REWARDS, RLOO_GROUPS)):
        s = Sample(
            prompt_id=f"p{group}",
            tokens=[1, 2, 3],
            prompt_length=2,
            group_index=group,
            index=i,
            session_id=f"s{i}",
            status=Status.COMPLETED,
            finish_reason="stop",
            reward=reward,
        )
        s.response_length, s.loss_mask = 1, [1]
        samples.append(s)
    samples[3].status = Status.FAILED  # left out of its group's baselines
    batch = build_batch(samples, cfg)
    order = sorted(range(len(samples)), key=lambda i: (RLOO_GROUPS[i], i))
    live = [i for i in range(len(samples)) if i != 3]
    expected = dict(zip(live, _rloo_reference([RLOO_REWARDS[i] for i in live], [RLOO_GROUPS[i] for i in live])))
    assert batch["advantage"] == pytest.approx([expected.get(i, 0.0) for i in order])


@pytest.mark.parametrize("estimator", ["grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_relative_estimators_refuse_groups_of_one(estimator):
    """A group baseline over one sample is that sample: every advantage 0 by construction."""
    from vime_core.config import load_config
    from vime_core.config.loader import ConfigError

    with pytest.raises(
        ConfigError, match=rf"n_samples_per_prompt=1 with advantage_estimator={estimator}: .* every advantage 0"
    ):
        load_config(overrides={"advantage_estimator": estimator, "n_samples_per_prompt": 1})


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus"])
def test_estimators_without_a_group_baseline_take_groups_of_one(estimator):
    from vime_core.config import load_config

    assert (
        load_config(overrides={"advantage_estimator": estimator, "n_samples_per_prompt": 1}).n_samples_per_prompt == 1
    )


def test_rollout_temperature_zero_is_refused_naming_the_field():
    """The trainer divides its logits by the rollout temperature: 0 has no distribution to score."""
    from vime_core.config import load_config
    from vime_core.config.loader import ConfigError

    with pytest.raises(ConfigError, match=r"rollout_temperature"):
        load_config(overrides={"rollout_temperature": 0.0})
