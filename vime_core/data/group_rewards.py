"""Which rewards count in a group's statistics, for the dynamic filters and the group normalisation:
a FAILED sample's 0.0 is a placeholder, so it neither moves its group's mean and std nor makes a
filter keep or drop the group. [1, 1, 1, FAILED] has live rewards [1, 1, 1]: std 0."""

from __future__ import annotations

from typing import Any, Iterable

from vime_core.data.sample import Status


def counts_in_group(sample: Any) -> bool:
    """Whether `sample`'s reward counts in its group's statistics (module docstring)."""
    return sample.status != Status.FAILED  # a str-valued status (a sample read back) compares too


def live_rewards(group: Iterable[Any]) -> list[float]:
    """The rewards of `group`'s samples that count (module docstring), in the group's order."""
    return [float(s.reward) for s in group if counts_in_group(s)]
