"""A dense reward for GPU runs on a randomly initialised model (bench/gpu/colocated_0.5b.yaml).

The arithmetic task's reward is 0 for every sample of a random model, so GRPO's group-centred
advantages are all 0 and the weights never change: a run could not show that a publish moves the
engine to new weights. This reward is the share of the response's tokens that are characters of
the task's alphabet (not the filler tokens `<|fN|>` that pad the vocabulary to Qwen's size):

    r = |{response characters outside filler tokens}| / response_length

It differs between the samples of a group, so the advantages are not 0 and every step changes
the policy.
"""

from __future__ import annotations

import re

FILLER = re.compile(r"<\|f\d+\|>")


def alphabet_share(sample) -> float:
    if not sample.response_length:
        return 0.0
    return min(1.0, len(FILLER.sub("", sample.response)) / sample.response_length)
