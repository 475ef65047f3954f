"""A dense reward for GPU runs on a randomly initialised model: the arithmetic task's reward is 0 for
every sample of a random model, so GRPO's advantages are all 0 and the weights never change. This
one, the share of response characters that are the task's alphabet (not filler tokens), differs
within a group, so every step changes the policy."""

from __future__ import annotations

import re

FILLER = re.compile(r"<\|f\d+\|>")


def alphabet_share(sample) -> float:
    if not sample.response_length:
        return 0.0
    return min(1.0, len(FILLER.sub("", sample.response)) / sample.response_length)
