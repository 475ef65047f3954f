"""can_reuse_log_probs_in_loss and should_flush_cache (vime_core/algo/gates.py)."""

from __future__ import annotations

import pytest

from vime_core.algo.gates import can_reuse_log_probs_in_loss, needs_critic, should_flush_cache
from vime_core.config import load_config
from vime_core.data.schedule import build_dp_schedule


def _num_microbatches(cfg) -> list[int]:
    n = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    return build_dp_schedule([10] * n, cfg.global_batch_size, 4, cfg.micro_batch_size).num_microbatches


def test_default_grpo_reuses_log_probs():
    cfg = load_config(
        overrides={
            "n_samples_per_prompt": 8,
            "actor_num_gpus_per_node": 8,
            "tensor_model_parallel_size": 2,
            "micro_batch_size": 8,
        }
    )
    assert _num_microbatches(cfg) == [8]
    assert can_reuse_log_probs_in_loss([8], cfg) is True


def test_four_steps_per_rollout_recomputes():
    cfg = load_config(
        overrides={
            "n_samples_per_prompt": 8,
            "actor_num_gpus_per_node": 8,
            "tensor_model_parallel_size": 2,
            "micro_batch_size": 8,
            "num_steps_per_rollout": 4,
        }
    )
    nmb = _num_microbatches(cfg)
    assert nmb == [2, 2, 2, 2]
    assert can_reuse_log_probs_in_loss(nmb, cfg) is False


@pytest.mark.parametrize(
    "override",
    [
        {"use_kl_loss": True, "kl_loss_coef": 0.01},
        {"kl_coef": 0.01, "advantage_estimator": "reinforce_plus_plus"},
        {"use_rollout_logprobs": True},
        {"get_mismatch_metrics": True},
        {"advantage_estimator": "gspo"},
        {"advantage_estimator": "ppo"},  # est.critic
        {"loss_type": "sft_loss"},
    ],
)
def test_each_condition_blocks_reuse(override):
    cfg = load_config(overrides=override)
    assert can_reuse_log_probs_in_loss([8], cfg) is False


def test_should_flush_cache_reference_numbers():
    assert should_flush_cache(1, 1, 0) is True  # first publish
    assert should_flush_cache(1, 2, 0) is True  # second publish


def test_should_flush_cache_interval():
    flushed = [v for v in range(1, 10) if should_flush_cache(3, v, 0)]
    assert flushed == [1, 4, 7]
    assert should_flush_cache(3, 6, 5) is True  # first publish after a resume at version 5
    assert should_flush_cache(3, 7, 5) is False
    with pytest.raises(ValueError, match="flush_cache_interval"):
        should_flush_cache(0, 1)
    with pytest.raises(ValueError, match="new_version"):
        should_flush_cache(1, 0, 0)


def test_kl_settings_mean_what_they_mean_in_slime():
    """kl_coef is the reward's KL penalty: an estimator without token rewards refuses it and says
    which flags give the loss term; a loss coefficient without use_kl_loss, or a reference
    checkpoint nothing uses, would silently do nothing and is refused."""
    with pytest.raises(
        ValueError,
        match=r"kl_coef=0.05 is the KL penalty in the token rewards .* advantage_estimator=grpo .* "
        r"use_kl_loss=true and kl_loss_coef=0.05",
    ):
        load_config(overrides={"kl_coef": 0.05})
    with pytest.raises(ValueError, match=r"kl_loss_coef=0.1 has no effect without use_kl_loss=true"):
        load_config(overrides={"kl_loss_coef": 0.1})
    with pytest.raises(ValueError, match=r"ref_load='ref' is set but no KL term uses the reference"):
        load_config(overrides={"ref_load": "ref"})
    cfg = load_config(overrides={"use_kl_loss": True, "kl_loss_coef": 0.1, "ref_load": "some/ref"})
    assert cfg.ref_load.startswith("/") and cfg.ref_load.endswith("some/ref")
    assert (
        load_config(overrides={"kl_coef": 0.05, "advantage_estimator": "reinforce_plus_plus_baseline"}).kl_coef == 0.05
    )


def test_only_ppo_needs_a_critic():
    assert needs_critic(load_config(overrides={"advantage_estimator": "ppo"})) is True
    assert not any(
        needs_critic(load_config(overrides={"advantage_estimator": name}))
        for name in ("grpo", "gspo", "cispo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
    )
