"""The rollout's side of the compute ledger (vime_core/ledger.py): every response token the
engines generate in one rollout is counted once, then assigned to where it went:

    add(sample, n)          n tokens generated for `sample` in this rollout
    discard(cause, group)   the group's tokens counted so far go to `cause` (CAUSES)
    take_back(group)        a discarded group is kept after all (filter_exhausted=keep_rejected)
    close(kept)             the kept samples' tokens: loss-mask-1 ones are trainable, FAILED
                            samples' are reward_failed, the other mask-0 ones masked; whatever
                            is still counted (requests cut when the batch was full) is aborted

so generated = trainable + sum(discarded) by construction. A kept sample continued from an
earlier rollout (partial_rollout) also holds that rollout's tokens, masked: only those generated
in this rollout count here (the per-sample count); the older ones were counted as aborted there.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from vime_core.data.group_rewards import counts_in_group
from vime_core.data.sample import Sample, Status
from vime_core.ledger import ROLLOUT_TOKENS


class RolloutTokens:
    """Token counts of one rollout (module docstring); samples are tracked by identity."""

    def __init__(self) -> None:
        self.generated = 0
        self.discarded: collections.Counter = collections.Counter()
        self._open: dict[int, int] = {}  # id(sample) -> tokens generated, not yet assigned
        self._given: dict[int, tuple[str, int]] = {}  # id(sample) -> (cause, tokens) it was discarded with

    def add(self, sample: Sample, n: int) -> None:
        self.generated += n
        self._open[id(sample)] = self._open.get(id(sample), 0) + n

    def discard(self, cause: str, group: Sequence[Sample]) -> None:
        for s in group:
            n = self._open.pop(id(s), 0)
            self._given[id(s)] = (cause, n)
            self.discarded[cause] += n

    def take_back(self, groups: Iterable[Sequence[Sample]]) -> None:
        for group in groups:
            for s in group:
                cause, n = self._given.pop(id(s), ("", 0))
                if cause:
                    self.discarded[cause] -= n
                    self._open[id(s)] = self._open.get(id(s), 0) + n

    def close(self, kept: Sequence[Sample]) -> dict:
        """The counts (ledger.ROLLOUT_TOKENS' value) once `kept` are the samples handed on."""
        trainable = truncated = 0
        for s in kept:
            n = self._open.pop(id(s), 0)
            if not counts_in_group(s):
                self.discarded["reward_failed"] += n
                continue
            mine = min(n, sum(s.loss_mask))  # mask-1 tokens are this rollout's (older ones are masked)
            trainable += mine
            self.discarded["masked"] += n - mine
            truncated += mine if s.status is Status.TRUNCATED else 0
        self.discarded["aborted"] += sum(self._open.values())
        self._open.clear()
        return {
            "generated": self.generated,
            "trainable": trainable,
            "truncated": truncated,
            "discarded": {cause: n for cause, n in self.discarded.items() if n},
        }


def generated_tokens(metrics: dict) -> int:
    """The tokens a rollout generated, from its metrics."""
    return int((metrics.get(ROLLOUT_TOKENS) or {}).get("generated", 0))


def add_stale(metrics: dict, stale: int) -> int:
    """Count `stale` tokens (of prefetched rollouts discarded before this one) in this rollout's
    metrics, as generated and discarded as stale; returns what is left to count (0)."""
    tokens = metrics.get(ROLLOUT_TOKENS)
    if stale and tokens is not None:
        tokens["generated"] += stale
        tokens["discarded"]["stale"] = tokens["discarded"].get("stale", 0) + stale
        return 0
    return stale
