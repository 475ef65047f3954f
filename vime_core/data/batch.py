"""Samples -> the rollout batch: a `dict[str, list]` of columns, one entry per sample, rows sorted by
(group_index, index) so groups are contiguous, with the rewards shaped and group-normalised into
each sample's advantage."""

from __future__ import annotations

import json
from typing import Sequence

from vime_core.algo.advantages import postprocess_rewards
from vime_core.algo.shaping import shape_rewards
from vime_core.data.columns import COLUMN_NAMES
from vime_core.data.group_rewards import counts_in_group
from vime_core.data.sample import Sample, Status
from vime_core.data.validation import validate_trainable


# A FAILED sample's loss mask is stored as zeros (no gradient); the mask it had is kept in its metadata
# under this key, as runs [[value, count], ...], so that `vime rescore`, scoring it again, trains it as
# generated (tool tokens and a requeued prefix at 0).
MASK_BEFORE_FAILURE_KEY = "loss_mask_before_failure"


def mask_runs(mask: Sequence[int]) -> list[list[int]]:
    """[1, 1, 0, 1] -> [[1, 2], [0, 1], [1, 1]]."""
    runs: list[list[int]] = []
    for value in mask:
        if runs and runs[-1][0] == value:
            runs[-1][1] += 1
        else:
            runs.append([int(value), 1])
    return runs


def mask_of_runs(runs: Sequence[Sequence[int]]) -> list[int]:
    return [int(value) for value, count in runs for _ in range(int(count))]


def _stored_metadata(s: Sample, failed: bool) -> str:
    metadata = {**s.metadata, MASK_BEFORE_FAILURE_KEY: mask_runs(s.loss_mask)} if failed else s.metadata
    return json.dumps(metadata, sort_keys=True, default=str)


def _check_scored(s: Sample) -> None:
    if s.reward is None and s.status != Status.FAILED:
        raise ValueError(
            (
                f"sample {s.group_index}/{s.index} (prompt {s.prompt_id!r}): reward is None; score samples before "
                f"building the batch"
            )
        )


def build_batch(samples: Sequence[Sample], cfg, is_eval: bool = False) -> dict[str, list]:
    """The batch of `samples`: the columns of vime_core.data.columns in their order (formulas
    below); raises UntrainableBatchError for a sample whose lengths disagree
    (data/validation.py, lengths_only: trainability is checked by whoever hands the batch on).

        raw_reward_i = sample.reward                 (0.0 for a FAILED sample)
        shaped_i     = shape_rewards(raw, response_length, cfg)_i        (algo/shaping.py)
        reward_i     = postprocess_rewards(shaped, group_index, ...)_i   over non-failed samples
                                                                         (algo/advantages.py)
        advantage_i  = reward_i

    raw_reward stays unshaped (the reward metrics read it, so the overlong penalty moves advantages,
    not the learning curve). Failed samples get rewards and advantage 0.0 and a zero loss mask: kept
    for lineage, no gradient, no effect on their group's mean or std; the mask they had is kept in
    their metadata (MASK_BEFORE_FAILURE_KEY) for a rescore."""
    ordered = sorted(samples, key=lambda s: (s.group_index, s.index))
    for s in ordered:
        _check_scored(s)
    failed = [not counts_in_group(s) for s in ordered]  # the filters' rule too (group_rewards.py)
    raw = [0.0 if f else float(s.reward) for s, f in zip(ordered, failed)]
    live = [i for i, f in enumerate(failed) if not f]
    live_rewards = postprocess_rewards(
        shape_rewards([raw[i] for i in live], [ordered[i].response_length for i in live], cfg),
        [ordered[i].group_index for i in live],
        cfg.advantage_estimator,
        cfg.grpo_std_normalization,
    )
    reward = [0.0] * len(ordered)
    for i, r in zip(live, live_rewards, strict=True):
        reward[i] = r
    values = {
        "prompt_id": [s.prompt_id for s in ordered],
        "group_index": [s.group_index for s in ordered],
        "index": [s.index for s in ordered],
        "tokens": [list(s.tokens) for s in ordered],
        "prompt_length": [s.prompt_length for s in ordered],
        "response_length": [s.response_length for s in ordered],
        "total_length": [len(s.tokens) for s in ordered],
        "loss_mask": [[0] * s.response_length if f else list(s.loss_mask) for s, f in zip(ordered, failed)],
        "rollout_log_probs": [list(s.rollout_log_probs) for s in ordered],
        "raw_reward": raw,
        "reward": reward,
        "advantage": list(reward),
        "status": [s.status.value for s in ordered],
        "finish_reason": [s.finish_reason for s in ordered],
        "weight_versions": [
            [{"version": w.version, "start": w.start, "end": w.end} for w in s.weight_versions] for s in ordered
        ],
        "session_id": [s.session_id for s in ordered],
        "is_eval": [is_eval] * len(ordered),
        "metadata": [_stored_metadata(s, f) for s, f in zip(ordered, failed)],
        "routed_experts": [s.routed_experts for s in ordered],
    }
    batch = {name: values[name] for name in COLUMN_NAMES}
    validate_trainable(batch, lengths_only=True)
    return batch


def weight_version_range(batch: dict) -> dict[str, int]:
    """{"weight_version_min", "weight_version_max"} over every span of every sample's
    weight_versions (the engines' versions that generated its tokens); {} when none recorded."""
    versions = [
        int(span["version"])
        for spans in batch.get("weight_versions", [])
        for span in spans
        if span.get("version") is not None
    ]
    return {"weight_version_min": min(versions), "weight_version_max": max(versions)} if versions else {}
