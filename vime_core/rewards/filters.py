"""Dynamic-sampling group filters: `filter(group: list[Sample]) -> bool` (True keeps the group).

check_reward_nonzero_std keeps a group only when its rewards are not all equal: with
std = 0 every GRPO advantage (r - mean) / (std + 1e-6) is 0 and the group adds no gradient
(DAPO's dynamic sampling, Yu et al. 2025).
"""

from __future__ import annotations

from typing import Callable

from vime_core.utils.imports import load_function


def _raw_reward(sample) -> float:
    # The filter runs after scoring and before normalisation; a failed sample scored 0.0.
    return float(sample.reward) if sample.reward is not None else 0.0


def check_reward_nonzero_std(group: list) -> bool:
    rewards = [_raw_reward(s) for s in group]
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
