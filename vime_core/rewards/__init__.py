"""Rewards: the hub that scores samples, rule-based checkers, a remote reward model client, and
dynamic-sampling group filters."""

from vime_core.rewards.hub import BUILTIN_REWARDS, RewardHub

__all__ = ["RewardHub", "BUILTIN_REWARDS"]
