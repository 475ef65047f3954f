"""The batch builder: columns, group normalisation, failed samples, validation."""

from __future__ import annotations

import json
import random
import statistics

import pytest

from vime_core.config import load_config
from vime_core.data.batch import build_batch
from vime_core.data.columns import COLUMN_NAMES
from vime_core.data.sample import Sample, Status, WeightSpan

REFERENCE_GROUP = [1, 0, 0, 1, 1, 0, 1, 0]


def _sample(group: int, index: int, reward, n_resp: int = 3, status=Status.COMPLETED) -> Sample:
    s = Sample(
        prompt_id=f"p{group}",
        tokens=[1, 2],
        prompt_length=2,
        group_index=group,
        index=index,
        session_id=f"r-{group}-{index}",
        status=status,
        finish_reason="stop",
        reward=reward,
    )
    s.append_response_tokens(list(range(10, 10 + n_resp)), [-0.5] * n_resp)
    s.weight_versions = [WeightSpan(1, 0, n_resp)]
    return s


def _cfg(**over):
    return load_config(overrides=over)


def test_columns_are_the_defined_ones_in_order():
    batch = build_batch([_sample(0, i, float(r)) for i, r in enumerate(REFERENCE_GROUP)], _cfg())
    assert tuple(batch) == COLUMN_NAMES
    assert all(len(v) == len(REFERENCE_GROUP) for v in batch.values())


def test_reference_group_normalisation_keeps_raw():
    samples = [_sample(0, i, float(r)) for i, r in enumerate(REFERENCE_GROUP)]
    batch = build_batch(samples, _cfg())
    assert batch["raw_reward"] == [float(r) for r in REFERENCE_GROUP]
    mean, std = statistics.mean(REFERENCE_GROUP), statistics.stdev(REFERENCE_GROUP)
    assert batch["reward"] == pytest.approx([(r - mean) / (std + 1e-6) for r in REFERENCE_GROUP])
    assert round(batch["reward"][0], 4) == 0.9354 and round(batch["reward"][1], 4) == -0.9354
    assert batch["advantage"] == batch["reward"]
    assert batch["total_length"] == [5] * 8 and batch["loss_mask"][0] == [1, 1, 1]
    assert batch["weight_versions"][0] == [{"version": 1, "start": 0, "end": 3}]
    assert batch["status"][0] == "completed" and json.loads(batch["metadata"][0]) == {}


def test_all_ones_group_is_zero_and_groups_are_independent():
    samples = [_sample(0, i, 1.0) for i in range(4)] + [_sample(1, i, float(i)) for i in range(4)]
    random.Random(0).shuffle(samples)  # rows come back sorted by (group_index, index)
    batch = build_batch(samples, _cfg())
    assert batch["group_index"] == [0] * 4 + [1] * 4 and batch["index"] == [0, 1, 2, 3] * 2
    assert batch["reward"][:4] == [0.0] * 4
    std = statistics.stdev([0, 1, 2, 3])
    assert batch["reward"][4:] == pytest.approx([(r - 1.5) / (std + 1e-6) for r in range(4)])


def test_estimator_variants():
    samples = [_sample(0, i, float(r)) for i, r in enumerate([2.0, 0.0, 1.0])]
    assert build_batch(samples, _cfg(advantage_estimator="reinforce_plus_plus_baseline"))["reward"] == pytest.approx(
        [1.0, -1.0, 0.0]
    )
    assert build_batch(samples, _cfg(advantage_estimator="reinforce_plus_plus"))["reward"] == [2.0, 0.0, 1.0]
    assert build_batch(samples, _cfg(grpo_std_normalization=False))["reward"] == pytest.approx([1.0, -1.0, 0.0])


def test_failed_samples_have_zero_reward_and_mask_and_do_not_move_the_group():
    samples = [_sample(0, i, float(r)) for i, r in enumerate([1.0, 0.0, 1.0])]
    failed = _sample(0, 3, None, status=Status.FAILED)
    failed.metadata["reward_error"] = "RuntimeError: boom"
    batch = build_batch(samples + [failed], _cfg())
    assert batch["raw_reward"][3] == 0.0 and batch["reward"][3] == 0.0
    assert batch["loss_mask"][3] == [0, 0, 0] and batch["status"][3] == "failed"
    std = statistics.stdev([1.0, 0.0, 1.0])
    mean = 2 / 3
    assert batch["reward"][:3] == pytest.approx([(r - mean) / (std + 1e-6) for r in [1.0, 0.0, 1.0]])
    # the mask it had, for a rescore (data/batch.py: MASK_BEFORE_FAILURE_KEY)
    assert json.loads(batch["metadata"][3]) == {
        "reward_error": "RuntimeError: boom",
        "loss_mask_before_failure": [[1, len(failed.loss_mask)]],
    }


def test_inconsistent_samples_are_rejected_with_their_id():
    s = _sample(2, 5, 1.0)
    s.rollout_log_probs.pop()
    with pytest.raises(
        ValueError, match=r"group 2 index 5, prompt 'p2'\): rollout_log_probs has 2 entries, response_length=3"
    ):
        build_batch([s], _cfg())
    unscored = _sample(0, 0, None)
    with pytest.raises(ValueError, match="reward is None"):
        build_batch([unscored], _cfg())
    s2 = _sample(0, 0, 1.0)
    s2.tokens.append(3)
    with pytest.raises(ValueError, match="6 tokens != prompt_length 2"):
        build_batch([s2], _cfg())


def test_is_eval_flag():
    assert build_batch([_sample(0, 0, 1.0)], _cfg(), is_eval=True)["is_eval"] == [True]
