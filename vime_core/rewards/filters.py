"""Dynamic-sampling group filters: `filter(group: list[Sample]) -> bool` (True keeps the group), after
scoring and before the normalisation, on the rewards that count (data/group_rewards.py).
check_reward_nonzero_std keeps a group only when at least two rewards count and differ: with std 0
every GRPO advantage is 0 (DAPO's dynamic sampling, Yu et al. 2025). It judges the scorer's rewards,
before the overlong length penalty (overlong_buffer_enable, algo/shaping.py), as DAPO filters on
accuracy: with the penalty on, a kept group's shaped rewards can still be equal (advantages 0) and a
dropped group's differ by the penalty alone."""

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
