"""The built-in rewards that `rm_type` names: where each function lives and whether it scores a
response against the prompt's label. A leaf (no vime_core import, no torch): the configuration's
check of rm_type (config/derive.py), the prompt loader (data/prompt_checks.py) and the reward hub
(rewards/hub.py) read this one table."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinReward:
    function: str  # "module:function"; "" for remote_rm, a client of rm_url (rewards/remote.py)
    reads_label: bool  # scores the response against the prompt's label (label_key)


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    "math": BuiltinReward("vime_core.rewards.math_checker:math_reward", reads_label=True),
    "exact_match": BuiltinReward("vime_core.rewards.scorers:exact_match_reward", reads_label=True),
    "f1": BuiltinReward("vime_core.rewards.scorers:f1_reward", reads_label=True),
    "arith": BuiltinReward("vime_core.demo.task:reward", reads_label=True),
    "remote_rm": BuiltinReward("", reads_label=False),  # the remote model scores prompt and response
}
LABEL_READING_REWARDS = frozenset(name for name, reward in BUILTIN_REWARDS.items() if reward.reads_label)
