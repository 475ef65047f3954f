"""Multi-turn generation with one tool, for the custom generate hook (`custom_generate_function_path`):
model turns go token-in/token-out through the engines (generate_sample), tool turns are appended as
tokens the model did not generate (loss mask 0), as slime's multi-turn examples and verl's agent loop."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass
from typing import Awaitable, Optional, Protocol, Union

from vime_core.data.sample import Sample, Status
from vime_core.data.turns import MODEL, TURNS_KEY, model_span, tool_span
from vime_core.rollout.generate import GenerateContext, decode_response, generate_sample, refuse_failed

TOOL_CALLS_KEY = "tool_calls"
UNANSWERED_CALL_KEY = "unanswered_call"
DEFAULT_TOOL_TIMEOUT_S = 10.0


@dataclass
class ToolResult:
    """A tool's answer: the call as it read it, the text appended as the tool turn, and why it
    gave no result (None when it did)."""

    call: str
    output: str
    error: Optional[str] = None


class Tool(Protocol):
    call_marker: str
    """The text that ends a model turn with a call; sent to the engine as a stop string."""

    def __call__(self, response_text: str) -> Union[ToolResult, Awaitable[ToolResult]]: ...


def with_stop(sampling_params: dict, marker: str) -> dict:
    """`sampling_params` with `marker` among its stop strings."""
    params = dict(sampling_params)
    stop = list(params.get("stop") or [])
    if marker not in stop:
        stop.append(marker)
    params["stop"] = stop
    return params


async def call_tool(tool: Tool, response_text: str, timeout_s: float) -> ToolResult:
    """The tool's answer to `response_text`, or an empty one naming the timeout.

    A tool is `tool(response_text) -> ToolResult` (or a coroutine function) with a `call_marker`
    attribute; a plain function runs in a worker thread so the rollout's event loop never waits on it.
    A tool that raises is a bug in the tool: the exception ends the rollout."""
    is_async = inspect.iscoroutinefunction(tool) or inspect.iscoroutinefunction(getattr(tool, "__call__", None))
    pending = tool(response_text) if is_async else asyncio.to_thread(tool, response_text)
    try:
        return await asyncio.wait_for(pending, timeout_s)
    except asyncio.TimeoutError:
        return ToolResult(call="", output="", error=f"the tool did not answer within {timeout_s:g} s")


def _room(ctx: GenerateContext, sample: Sample) -> int:
    """Tokens the sample may still grow by (response budget and engine context)."""
    cfg = ctx.cfg
    return max(
        0, min(cfg.rollout_max_response_len - sample.response_length, cfg.rollout_max_context_len - len(sample.tokens))
    )


def _decode(ctx: GenerateContext, token_ids: list[int]) -> str:
    """A turn's text as the engine matched its stop strings: with rollout_skip_special_tokens as the
    request said (a call marker that is a special token is in the text only without skipping)."""
    return ctx.tokenizer.decode(token_ids, skip_special_tokens=ctx.cfg.rollout_skip_special_tokens)


async def generate_multi_turn(
    ctx: GenerateContext,
    sample: Sample,
    sampling_params: dict,
    tool: Tool,
    max_turns: int,
    tool_timeout_s: float = DEFAULT_TOOL_TIMEOUT_S,
) -> Sample:
    """Generate (or continue) one sample of up to `max_turns` model turns with `tool` answering the calls
    in between; returns it.

        for t = 0, 1, ...:
            model turn t: generate_sample continues the sample (as token ids: never re-tokenized) until
                          the tool's call marker (a stop string), EOS, or the response budget
            no marker                           -> done (its status as generated)
            marker and t + 1 == max_turns       -> TRUNCATED, metadata unanswered_call = True
            marker and no response budget left  -> the same, finish reason "length"
            marker                              -> tool turn t: tool(response text so far); its token ids
                                                   appended with loss mask 0 and log-prob 0.0, cut to the
                                                   response budget (then TRUNCATED, "length")

    The response budget (rollout_max_response_len) covers model and tool tokens; every turn is a span in
    metadata["turns"] (vime_core/data/turns.py), metadata["tool_calls"] counts the calls. A resumed
    sample (partial_rollout) continues its aborted turn; one given back with no response starts over."""
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    if sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.response_length:
        return sample  # finished before an abort; came back with its group
    refuse_failed(sample)
    if sample.response_length == 0:  # a fresh sample, or a group generated again from its prompt
        sample.metadata[TURNS_KEY] = []
        sample.metadata.pop(TOOL_CALLS_KEY, None)
        sample.metadata.pop(UNANSWERED_CALL_KEY, None)
    turns: list[dict] = sample.metadata.setdefault(TURNS_KEY, [])
    params = with_stop(sampling_params, tool.call_marker)
    try:
        while True:
            resumed = bool(turns) and turns[-1]["role"] == MODEL and turns[-1]["finish"] == "abort"
            turn = turns[-1]["turn"] if resumed else sum(span["role"] == MODEL for span in turns)
            start = turns[-1]["start"] if resumed else sample.response_length
            before = sample.response_length
            sample.status = Status.PENDING
            await generate_sample(ctx, sample, dict(params))
            if sample.response_length > before or resumed:
                span = model_span(turn, start, sample.response_length, sample.finish_reason)
                if resumed:
                    turns[-1] = span
                else:
                    turns.append(span)
            if sample.status is not Status.COMPLETED:
                return sample  # aborted, failed, or out of response budget
            turn_text = _decode(ctx, sample.response_tokens[start:])
            if tool.call_marker not in turn_text:
                return sample  # the model answered without a call: done
            room = _room(ctx, sample)
            if turn + 1 >= max_turns or room == 0:
                sample.status = Status.TRUNCATED
                if room == 0:
                    sample.finish_reason = "length"
                sample.metadata[UNANSWERED_CALL_KEY] = True
                return sample
            result = await call_tool(tool, _decode(ctx, sample.response_tokens), tool_timeout_s)
            ids = list(ctx.tokenizer.encode(result.output, add_special_tokens=False)) if result.output else []
            tool_start = sample.response_length
            sample.append_response_tokens(ids[:room], [0.0] * len(ids[:room]), loss_mask_value=0)
            turns.append(tool_span(turn, tool_start, sample.response_length, result.call, result.output, result.error))
            sample.metadata[TOOL_CALLS_KEY] = sample.metadata.get(TOOL_CALLS_KEY, 0) + 1
            if len(ids) > room or _room(ctx, sample) == 0:
                sample.status, sample.finish_reason = Status.TRUNCATED, "length"
                return sample
    finally:
        if sample.response_length:
            sample.response = decode_response(
                ctx.tokenizer, sample, ctx.cfg.rollout_skip_special_tokens, ctx.eos_token_id
            )
