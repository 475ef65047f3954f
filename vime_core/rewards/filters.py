"""Dynamic-sampling group filters: `filter(group: list[Sample]) -> bool` (True keeps the group).

A filter gets the whole group, after scoring and before the normalisation. The rewards that count
are those of its samples that are not FAILED, `data.group_rewards.live_rewards(group)`: the same set the
normalisation uses (data/batch.py), so a filter never keeps a group whose advantages are all 0.

check_reward_nonzero_std keeps a group only when at least two of its rewards count and they are
not all equal: with std = 0 every GRPO advantage (r - mean) / (std + 1e-6) is 0 and the group adds
no gradient (DAPO's dynamic sampling, Yu et al. 2025). [1, 1, 1, FAILED] is dropped: the three
rewards that count are equal.

How many batches a rollout may submit while a filter leaves it short, and what then, is the
rollout loop's (max_num_gen_batches, filter_exhausted).
"""

from __future__ import annotations

from typing import Callable

from vime_core.data.group_rewards import live_rewards
from vime_core.utils.imports import load_function


def check_reward_nonzero_std(group: list) -> bool:
    rewards = live_rewards(group)
    if len(rewards) < 2:
        return False
    mean = sum(rewards) / len(rewards)
    return sum((r - mean) ** 2 for r in rewards) > 0.0


def load_filter(path: str, field: str = "dynamic_sampling_filter_path") -> Callable[[list], bool]:
    """The filter at `module:function`; an empty path keeps every group."""
    if not path:
        return keep_all
    return load_function(path, field=field)


def keep_all(group: list) -> bool:
    return True
