"""Which rewards count in a group's statistics, in one place for the dynamic filters
(rewards/filters.py) and the batch builder's group normalisation (data/batch.py):

    counts_in_group(s)  = s is not FAILED: a FAILED sample has no reward (its 0.0 is a
                          placeholder, rewards/hub.py); it neither moves its group's mean and std
                          in the normalisation nor makes a filter keep or drop its group
    live_rewards(group) = [float(s.reward) for s in group if counts_in_group(s)]

So a group [1, 1, 1, FAILED] has live rewards [1, 1, 1]: std 0, every advantage 0, and
check_reward_nonzero_std drops it.
"""

from __future__ import annotations

from typing import Any, Iterable

from vime_core.data.sample import Status


def counts_in_group(sample: Any) -> bool:
    """Whether `sample`'s reward counts in its group's statistics (module docstring)."""
    return sample.status != Status.FAILED  # a str-valued status (a sample read back) compares too


def live_rewards(group: Iterable[Any]) -> list[float]:
    """The rewards of `group`'s samples that count (module docstring), in the group's order."""
    return [float(s.reward) for s in group if counts_in_group(s)]
