"""Reward and generate hooks loaded by path in the rollout integration tests."""

from __future__ import annotations


def parity_reward(sample) -> float:
    """Even groups get a constant reward (std 0: the filter drops them); odd groups get the
    sample's index parity, so they always keep a non-zero std."""
    if sample.group_index % 2 == 0:
        return 1.0
    return float(sample.index % 2)


def index_reward(sample) -> float:
    return float(sample.index % 2)


def raising_reward(sample) -> float:
    raise RuntimeError(f"reward exploded on {sample.prompt_id}")
