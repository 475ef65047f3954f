"""The rollout's half of routing replay: each request asks for the routed experts of the tokens the
sample does not hold rows for yet (`routed_experts_prompt_start` = rows held), and the answer's rows
(vLLM's `choices[0].routed_experts`: base64 of `np.save` bytes) are appended to the sample, so that
after every call rows = len(tokens) - 1 (vime_core/data/routed_experts.py)."""

from __future__ import annotations

import base64
import binascii
from typing import Optional

import numpy as np

from vime_core.data import routed_experts
from vime_core.data.sample import Sample
from vime_core.engines.client import ROUTED_EXPERTS_START


def held_rows(sample: Sample) -> int:
    return 0 if sample.routed_experts is None else routed_experts.decode(sample.routed_experts).shape[0]


def with_routing_request(params: dict, sample: Sample) -> dict:
    """`params` asking for the rows from the first token the sample holds none for."""
    return dict(params, **{ROUTED_EXPERTS_START: held_rows(sample)})


def choice_rows(answer: dict) -> Optional[np.ndarray]:
    """Choice 0's routed experts [rows, layers, top_k]; None when it has none. ValueError
    (a RoutedExpertsError) when they are not base64 of a routed-experts .npy array."""
    raw = ((answer.get("choices") or [{}])[0] or {}).get("routed_experts")
    if raw is None:
        return None
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, TypeError, ValueError):
        raise routed_experts.RoutedExpertsError("routed_experts is not base64") from None
    return routed_experts.decode(data)


def append_rows(sample: Sample, rows: Optional[np.ndarray], start: int, new_tokens: int) -> None:
    """Append an answer's `rows` (from token `start`) to `sample`, whose tokens the answer's
    `new_tokens` were just appended to. An answer that generated tokens must bring rows up to
    len(tokens) - 1; one without tokens (aborted before its first step) may bring none."""
    if rows is None:
        if new_tokens:
            raise routed_experts.RoutedExpertsError("the answer has tokens but no routed_experts")
        return
    sample.routed_experts = routed_experts.appended(sample.routed_experts, rows, start, len(sample.tokens))
    if new_tokens and start + rows.shape[0] != len(sample.tokens) - 1:
        raise routed_experts.RoutedExpertsError(
            f"routed_experts rows reach token {start + rows.shape[0]}, the sample has {len(sample.tokens)} tokens"
        )
