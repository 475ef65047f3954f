"""Reward functions loaded by path (custom_rm_path) in the run guard's integration test."""

from __future__ import annotations

from vime_core.demo.task import reward as arith_reward

GROUPS_PER_ROLLOUT = 4  # the test's rollout_batch_size: rollout k draws groups 4k .. 4k+3
BAD_ROLLOUTS = (2, 5)
_failed: set[tuple[int, int]] = set()  # in the RolloutManager's process


def fails_once_at_rollouts_2_and_5(sample) -> float:
    """The demo's reward, except that every other sample of rollout 2's and 5's groups raises the
    first time it is scored (a reward server that went down for one rollout): half of that
    rollout's reward calls fail; the same prompts drawn again score normally."""
    bad = sample.group_index // GROUPS_PER_ROLLOUT in BAD_ROLLOUTS
    key = (sample.group_index, sample.index)
    if bad and sample.index % 2 == 0 and key not in _failed:
        _failed.add(key)
        raise ConnectionError("reward server unreachable")
    return arith_reward(sample)
