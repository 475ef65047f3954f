"""Per-turn spans of a multi-turn sample, in its metadata (stored with the batch, no schema change):
which response tokens the model generated and which a tool appended, turn by turn.

    metadata["turns"] = [span, ...]     in response order, contiguous, covering [0, response_length)
    span = {"turn": t, "role": "model", "start": s, "end": e, "finish": <engine finish reason>}
         | {"turn": t, "role": "tool", "start": s, "end": e, "call": ..., "output": ..., "error": ...}

Offsets index the response tokens; tool tokens carry loss mask 0. A sample without the key reads as
one model turn over the whole response."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping, Optional, Sequence

TURNS_KEY = "turns"
MODEL, TOOL = "model", "tool"


def model_span(turn: int, start: int, end: int, finish: str) -> dict:
    return {"turn": turn, "role": MODEL, "start": start, "end": end, "finish": finish}


def tool_span(turn: int, start: int, end: int, call: str, output: str, error: Optional[str] = None) -> dict:
    span = {"turn": turn, "role": TOOL, "start": start, "end": end, "call": call, "output": output}
    if error:
        span["error"] = error
    return span


def _metadata_dict(metadata: Any) -> dict:
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata) if metadata else {}
        except ValueError:
            return {}
    return metadata if isinstance(metadata, dict) else {}


def turns_of(metadata: Any, response_length: int) -> list[dict]:
    """The turn spans of a sample from its metadata (dict or the stored JSON string); one model
    span over the whole response when it records none (module docstring)."""
    turns = _metadata_dict(metadata).get(TURNS_KEY)
    if turns:
        return [dict(span) for span in turns]
    return [model_span(0, 0, response_length, "")] if response_length else []


def turns_error(turns: Sequence[Mapping], response_length: int, loss_mask: Sequence[int]) -> Optional[str]:
    """What is wrong with `turns` for a response of `response_length` tokens and its `loss_mask`,
    in one line, or None: the spans must be contiguous from 0 to response_length, each a known
    role, and no tool token may be trained."""
    position = 0
    for i, span in enumerate(turns):
        if span.get("role") not in (MODEL, TOOL):
            return f"turn span {i} has role {span.get('role')!r}; expected {MODEL!r} or {TOOL!r}"
        if span["start"] != position or span["end"] < span["start"]:
            return f"turn span {i} covers [{span['start']}, {span['end']}) after a span ending at {position}"
        if span["role"] == TOOL and any(loss_mask[span["start"] : span["end"]]):
            return f"turn span {i} (tool, turn {span['turn']}) has tokens with loss mask 1"
        position = span["end"]
    if position != response_length:
        return f"turn spans end at {position}; the response has {response_length} tokens"
    return None


def sample_turns(
    batch: Mapping[str, Sequence[Any]], row: int, decode: Optional[Callable[[list[int]], str]] = None
) -> dict:
    """One stored sample (row `row` of a batch dict, as BatchStore.read gives) and its turns:
    each span with its token ids, how many of them are trained (loss mask 1), and its text when
    `decode` (token ids -> str) is given. `check` is turns_error's answer ("ok" when None)."""
    prompt_length = int(batch["prompt_length"][row])
    response_length = int(batch["response_length"][row])
    tokens = list(batch["tokens"][row])
    mask = list(batch["loss_mask"][row])
    response = tokens[prompt_length:]
    turns = turns_of(batch["metadata"][row], response_length)
    shown = []
    for span in turns:
        ids = response[span["start"] : span["end"]]
        view = {**span, "trained_tokens": int(sum(mask[span["start"] : span["end"]])), "token_ids": ids}
        if decode is not None:
            view["text"] = decode(ids)
        shown.append(view)
    out = {
        "row": row,
        "prompt_id": batch["prompt_id"][row],
        "group_index": batch["group_index"][row],
        "index": batch["index"][row],
        "status": batch["status"][row],
        "raw_reward": batch["raw_reward"][row],
        "prompt_length": prompt_length,
        "response_length": response_length,
        "check": turns_error(turns, response_length, mask) or "ok",
        "turns": shown,
    }
    if decode is not None:
        out["prompt"] = decode(tokens[:prompt_length])
    return out
