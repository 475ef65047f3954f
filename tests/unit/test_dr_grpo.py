"""Dr. GRPO (Liu et al. 2025): grpo_std_normalization=false with loss_agg_mode=seq_mean_token_sum_norm,
against numbers computed by hand: the advantages are r - mean(r) (no std), and the loss is each
sequence's token sum over the constant loss_scale_factor (default rollout_max_response_len),
averaged over sequences; the same whatever the micro-batch split of the step."""

from __future__ import annotations

import pytest
import torch

from vime_core.config import ConfigError, load_config

# two sequences, flat; sequence 0's last token is masked out
PER_TOKEN = [[2.0, -1.0, 5.0], [0.5, 0.5, 1.0, 3.0]]
MASK = [[1, 1, 0], [1, 1, 1, 1]]
LENGTHS = [3, 4]


def _flat(rows):
    return torch.tensor([x for row in rows for x in row], dtype=torch.float32)


def test_the_aggregation_divides_each_token_sum_by_the_constant():
    from vime_core.algo.losses import aggregate_loss

    # by hand: sums 2 - 1 = 1 and 0.5 + 0.5 + 1 + 3 = 5; mean 3; over L = 8
    assert aggregate_loss(
        _flat(PER_TOKEN), _flat(MASK), "seq_mean_token_sum_norm", LENGTHS, 8.0
    ).item() == pytest.approx(3 / 8)
    # the same in the padded [B, T] layout
    padded = torch.tensor([[2.0, -1.0, 5.0, 9.0], [0.5, 0.5, 1.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    assert aggregate_loss(padded, mask, "seq_mean_token_sum_norm", scale=8.0).item() == pytest.approx(3 / 8)
    # unlike seq_mean_token_mean ((1/2 + 5/4) / 2), a longer sequence is not down-weighted
    assert aggregate_loss(_flat(PER_TOKEN), _flat(MASK), "seq_mean_token_mean", LENGTHS).item() == pytest.approx(0.875)
    with pytest.raises(ValueError, match="needs a positive scale"):
        aggregate_loss(_flat(PER_TOKEN), _flat(MASK), "seq_mean_token_sum_norm", LENGTHS)


def test_dr_grpo_advantages_are_centred_not_scaled():
    from vime_core.algo.advantages import postprocess_rewards

    rewards, groups = [1.0, 0.0, 0.0, 1.0, 1.0, 0.5], [0, 0, 0, 1, 1, 1]
    # by hand: group 0 mean 1/3, group 1 mean 5/6
    expected = [2 / 3, -1 / 3, -1 / 3, 1 / 6, 1 / 6, -1 / 3]
    assert postprocess_rewards(rewards, groups, "grpo", grpo_std_normalization=False) == pytest.approx(expected)


def _cfg(**fields):
    return load_config(
        overrides={
            "hf_checkpoint": "some/model",
            "advantage_estimator": "grpo",
            "grpo_std_normalization": False,
            "loss_agg_mode": "seq_mean_token_sum_norm",
            "rollout_batch_size": 1,
            "n_samples_per_prompt": 2,
            "micro_batch_size": 1,
            "rollout_max_response_len": 8,
            "entropy_coef": 0.0,
            **fields,
        }
    )


def test_the_scale_defaults_to_the_response_budget_and_belongs_to_the_mode():
    assert _cfg().loss_scale_factor == 8.0
    assert _cfg(loss_scale_factor=100).loss_scale_factor == 100.0
    assert load_config(overrides={"loss_agg_mode": "token_mean"}).loss_scale_factor is None
    with pytest.raises(
        ConfigError, match="loss_scale_factor=4.0 has no effect without loss_agg_mode=seq_mean_token_sum_norm"
    ):
        load_config(overrides={"loss_scale_factor": 4})


@pytest.mark.parametrize("split", [[[0, 1]], [[0], [1]]])
def test_the_step_loss_is_the_same_whatever_the_micro_batches(monkeypatch, split):
    """At ratio 1 the PPO loss of a token is -A. By hand, A = +0.5 on sequence 0 (2 valid tokens)
    and -0.25 on sequence 1 (2 of its 3 valid): token sums -1.0 and +0.5, mean -0.25, over L = 8:
    -0.03125, for one micro-batch of both or one each (the step's shares)."""
    from vime_core.trainer import train_step

    cfg = _cfg()
    lengths, mask_rows, advantages = [2, 3], [[1, 1], [1, 1, 0]], [0.5, -0.25]
    batch = {"tokens": [[1, 2] + [7] * n for n in lengths], "response_length": lengths, "loss_mask": mask_rows}
    log_probs = {i: torch.full((n,), -1.0) for i, n in enumerate(lengths)}
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=split,
        denominators=train_step.StepDenominators.of(batch, [0, 1]),
        advantages={i: torch.full((n,), advantages[i]) for i, n in enumerate(lengths)},
        old_log_probs=log_probs,
    )
    total = 0.0
    for indices in split:
        current = torch.cat([log_probs[i] for i in indices]).requires_grad_()
        monkeypatch.setattr(
            train_step,
            "packed_response_log_probs",
            lambda *a, current=current, **k: (current, torch.zeros_like(current)),
        )
        mb = train_step.make_micro_batch(batch, indices, "cpu")
        total += train_step.micro_batch_loss(None, mb, inputs, cfg, 32, train_step._Accumulator()).item()
    assert total == pytest.approx(-0.03125, abs=1e-7)
