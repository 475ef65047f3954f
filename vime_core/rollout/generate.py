"""Single-turn, token-in/token-out generation of one sample: prompt and response ids go to an engine,
the new token ids, log-probs, finish reason and weight-version spans come back and are appended.
A token the engine sent no log-prob for is marked MISSING_LOGPROB and counted, so the trainability
check can refuse the sample where a flag reads log-probs (vime_core/data/validation.py)."""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from vime_core.config.derive import needs_rollout_logprobs
from vime_core.data.sample import MISSING_LOGPROB, MISSING_LOGPROBS_ENGINE, Sample, Status, WeightSpan
from vime_core.engines.adapters import ADAPTER_PREFIX, adapter_version
from vime_core.engines.client import ANSWERED_BY, ASKED_MODEL, ROUTED_EXPERTS_START, EngineError, parse_weight_version
from vime_core.rollout.routing import append_rows, choice_rows, with_routing_request
from vime_core.utils.retry import async_attempts

logger = logging.getLogger(__name__)

FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
MAX_RETRY_WAIT_S = 5.0


class Generator(Protocol):
    """What generate needs from an engine, the router or the in-client PolicyRouter."""

    async def generate(
        self,
        token_ids: list[int],
        sampling_params: dict,
        session_id: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> dict: ...


class MalformedResponse(ValueError):
    """The engine answered 200 with a body that cannot be turned into tokens + log-probs."""


@dataclass
class GenerateContext:
    """What one sample's generation needs; shared by every sample of a rollout."""

    cfg: Any
    generator: Generator
    tokenizer: Any
    eos_token_id: Optional[int] = None
    # Set when the rollout has what it needs: samples not yet sent are returned ABORTED.
    aborting: asyncio.Event = field(default_factory=asyncio.Event)
    # The version the engines serve when a request is admitted; recorded as the sample's span
    # where the engine reports no per-request spans (vLLM 0.26, engines/vllm_api.py).
    weight_version: Optional[int] = None
    # Cleared by pause_admission: new requests wait until it is set again.
    admission_open: Optional[Any] = None
    # Back-off between attempts of a request whose engine did not answer: after attempt n,
    # min(retry_backoff_s * 2^(n-1), MAX_RETRY_WAIT_S); the number of attempts is
    # cfg.rollout_request_max_attempts.
    retry_backoff_s: float = 0.5


def base_sampling_params(cfg: Any, temperature: Optional[float] = None, log_probs: Optional[bool] = None) -> dict:
    """vLLM sampling params of the configuration; each sample gets its own copy. `log_probs`:
    ask for the sampled tokens' log-probs (`logprobs: 0`); None: when a flag of the
    configuration reads them (needs_rollout_logprobs)."""
    params: dict[str, Any] = {
        "temperature": cfg.rollout_temperature if temperature is None else temperature,
        "top_p": cfg.rollout_top_p,
        "top_k": cfg.rollout_top_k,
        "skip_special_tokens": cfg.rollout_skip_special_tokens,
    }
    if needs_rollout_logprobs(cfg) if log_probs is None else log_probs:
        params["logprobs"] = 0
    if cfg.rollout_stop:
        params["stop"] = list(cfg.rollout_stop)
    if cfg.rollout_stop_token_ids:
        params["stop_token_ids"] = list(cfg.rollout_stop_token_ids)
    return params


def request_params(sampling_params: dict, max_tokens: int) -> dict:
    """One request's sampling params: `sampling_params` with `max_tokens`, and `detokenize`
    false unless stop strings are set (the server then needs the text to match them): vime
    decodes the response itself (`decode_response`), and the server's incremental
    detokenization is per-token work on its one event loop (its cost: the `tokens` variant of
    bench/results/rollout_vs_offline.jsonl, row 733a745)."""
    params = dict(sampling_params, max_tokens=max_tokens)
    params.setdefault("detokenize", bool(params.get("stop")))
    return params


def parse_choice(
    answer: dict, with_log_probs: bool = True
) -> tuple[list[int], Optional[list[float]], int, str, list[WeightSpan]]:
    """(token ids, log-probs, missing log-prob count, finish reason, spans) of choice 0; without
    `with_log_probs` (none were asked for) the log-probs are None and none is missing.

    Log-prob entries (`choices[0].logprobs.content[j]`) come in vLLM 0.26's shape
    {"token": "token_id:N", "logprob": x, "top_logprobs": [...]} or 0.32's {"token_id": N, "logprob": x,
    "rank": r, "top_logprobs": [...]}. An entry naming another token (then its top_logprobs are
    searched), without a value, or at -9999.0 (vLLM's value for none, log 0 and NaN) is MISSING_LOGPROB;
    asked for log-probs, an answer without any counts every token as missing. Token and log-prob
    counts that differ raise MalformedResponse.

    A request that named a vime LoRA adapter (`ASKED_MODEL`, lora_publish=adapter) was generated
    by that adapter from its admission to its end: its one span is the adapter's version,
    whatever version the engine reported meanwhile."""
    try:
        choice = answer["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise MalformedResponse(f"no choices in the response: {str(answer)[:200]}") from None
    token_ids = [int(t) for t in choice.get("token_ids") or []]
    spans = [
        WeightSpan(parse_weight_version(s.get("version")), int(s["start"]), int(s["end"]))
        for s in choice.get("weight_versions") or []
    ]
    adapter = adapter_version(str(answer.get(ASKED_MODEL) or ""))
    if adapter is not None:
        spans = [WeightSpan(adapter, 0, len(token_ids))] if token_ids else []
    finish = str(choice.get("finish_reason") or "")
    if not with_log_probs:
        return token_ids, None, 0, finish, spans
    entries = (choice.get("logprobs") or {}).get("content") or []
    if not entries:  # an engine that ignored the request: every token lacks its log-prob
        return token_ids, [MISSING_LOGPROB] * len(token_ids), len(token_ids), finish, spans
    if len(entries) != len(token_ids):
        raise MalformedResponse(f"{len(token_ids)} tokens but {len(entries)} log-probs in the response")
    log_probs, missing = [], 0
    for token, entry in zip(token_ids, entries):
        value = _sampled_logprob(token, entry)
        if value is None or math.isnan(value) or value <= MISSING_LOGPROB:
            missing += 1
            value = MISSING_LOGPROB
        log_probs.append(value)
    return token_ids, log_probs, missing, finish, spans


TOKEN_ID_PREFIX = "token_id:"


def entry_token_id(entry: dict) -> Optional[int]:
    """The token id a log-prob entry is for: its "token_id" (vLLM 0.32), else the N of a
    "token": "token_id:N" (vLLM 0.26, which sends no "token_id"); None when it names neither."""
    token_id = entry.get("token_id")
    if token_id is not None:
        return int(token_id)
    token = entry.get("token")
    if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
        try:
            return int(token[len(TOKEN_ID_PREFIX) :])
        except ValueError:
            return None
    return None


def _sampled_logprob(token: int, entry: dict) -> Optional[float]:
    if entry_token_id(entry) == token and entry.get("logprob") is not None:
        return float(entry["logprob"])
    for top in entry.get("top_logprobs") or []:
        if entry_token_id(top) == token and top.get("logprob") is not None:
            return float(top["logprob"])
    return None


def extend_spans(sample: Sample, spans: list[WeightSpan], offset: int) -> None:
    """Append spans shifted by `offset`, merging with the last one when the version continues."""
    for span in spans:
        shifted = WeightSpan(span.version, span.start + offset, span.end + offset)
        last = sample.weight_versions[-1] if sample.weight_versions else None
        if last is not None and last.version == shifted.version and last.end == shifted.start:
            last.end = shifted.end
        else:
            sample.weight_versions.append(shifted)


def decode_response(tokenizer: Any, sample: Sample, skip_special_tokens: bool, eos_token_id: Optional[int]) -> str:
    """The response text; a final EOS is not part of it (as in vLLM's own text output)."""
    ids = sample.response_tokens
    if ids and eos_token_id is not None and ids[-1] == eos_token_id and sample.finish_reason == "stop":
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def fail_sample(sample: Sample, reason: str, retryable: bool = False) -> Sample:
    """Mark a sample the engines did not generate. `retryable`: the cause was the infrastructure
    (no engine answered, a dropped connection, a garbled answer), not the request, so the same
    prompt on a live engine can succeed (the rollout loop generates its group again)."""
    sample.status = Status.FAILED
    sample.metadata["generate_error"] = reason
    sample.metadata["retryable"] = retryable
    return sample


def _no_answer(exc: BaseException) -> bool:
    """No engine gave an answer (refused, dropped, timed out) or it failed on its side (5xx): the
    request may succeed on the next attempt. A 4xx says the request itself is bad, except a 404
    for a vime adapter's name: an engine restarted and admitted again before its publish loaded
    the adapter (lora_publish=adapter), which it serves moments later."""
    if not isinstance(exc, EngineError):
        return False
    return exc.status is None or exc.status >= 500 or (exc.status == 404 and ADAPTER_PREFIX in exc.body)


async def _wait_for_admission(ctx: GenerateContext) -> None:
    while ctx.admission_open is not None and not ctx.admission_open.is_set():
        if ctx.aborting.is_set():
            return
        await asyncio.sleep(0.05)


def refuse_failed(sample: Sample) -> None:
    """A FAILED sample is never continued: requeue_partial gives it back as its prompt alone, and
    continuing a finished response would append after its EOS."""
    if sample.status is Status.FAILED:
        raise ValueError(
            f"sample {sample.group_index}/{sample.index} is FAILED: only a pending or aborted sample is generated"
        )


async def generate_sample(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    """Generate (or continue) one sample in place; returns it.

    max_new_tokens = rollout_max_response_len - response_length (0: TRUNCATED, no request). The request
    is prompt + response ids with `request_params`; the answer is appended with
    `Sample.append_response_tokens`, its spans shifted to index the whole response. Status: finish
    "stop" -> COMPLETED (also when EOS is the last allowed token), "length" -> TRUNCATED, "abort" -> ABORTED
    when this context is aborting, else the sample goes on (`_continue_after_foreign_abort`)."""
    cfg = ctx.cfg
    if sample.status in (Status.COMPLETED, Status.TRUNCATED) and sample.response_length:
        return sample  # finished before an abort; came back with its group
    refuse_failed(sample)
    budget = cfg.rollout_max_response_len - sample.response_length
    if budget <= 0:
        sample.status, sample.finish_reason = Status.TRUNCATED, "length"
        return sample
    context_room = cfg.rollout_max_context_len - len(sample.tokens)
    if context_room <= 0:
        return fail_sample(
            sample,
            (
                f"prompt+response of {len(sample.tokens)} tokens leaves no room in "
                f"rollout_max_context_len={cfg.rollout_max_context_len}"
            ),
        )
    params = request_params(sampling_params, min(budget, context_room))
    replay = bool(getattr(cfg, "use_rollout_routing_replay", False))
    if replay:
        params = with_routing_request(params, sample)

    answer = None
    max_attempts = ctx.cfg.rollout_request_max_attempts
    retrying = async_attempts(
        max_attempts,
        ctx.retry_backoff_s,
        max_s=MAX_RETRY_WAIT_S,
        retry_on=_no_answer,
        on_retry=lambda state: logger.info(
            "sample %s: attempt %d failed (%s); retrying",
            sample.session_id,
            state.attempt_number,
            state.outcome.exception(),
        ),
    )
    try:
        async for attempt in retrying:
            with attempt:
                await _wait_for_admission(ctx)
                if ctx.aborting.is_set():
                    sample.status = Status.ABORTED
                    return sample
                answer = await ctx.generator.generate(sample.tokens, params, session_id=sample.session_id or None)
    except EngineError as exc:
        if not _no_answer(exc):
            return fail_sample(sample, str(exc))  # the request itself is bad: retrying cannot help
        return fail_sample(sample, f"no engine answered after {max_attempts} attempts: {exc}", retryable=True)
    assert answer is not None

    try:
        token_ids, log_probs, missing, finish, spans = parse_choice(
            answer, with_log_probs=params.get("logprobs") is not None
        )
        rows = choice_rows(answer) if replay else None
    except (MalformedResponse, KeyError, TypeError, ValueError) as exc:
        return fail_sample(sample, f"malformed engine response: {exc}", retryable=True)
    if not spans and ctx.weight_version is not None and token_ids:
        spans = [WeightSpan(ctx.weight_version, 0, len(token_ids))]
    offset = sample.response_length
    sample.append_response_tokens(token_ids, log_probs)
    if replay:
        try:
            append_rows(sample, rows, params[ROUTED_EXPERTS_START], len(token_ids))
        except ValueError as exc:
            return fail_sample(sample, f"malformed engine response: {exc}", retryable=True)
    extend_spans(sample, spans, offset)
    if missing:
        sample.metadata["missing_logprobs"] = sample.metadata.get("missing_logprobs", 0) + missing
        sample.metadata[MISSING_LOGPROBS_ENGINE] = (
            answer.get(ANSWERED_BY) or getattr(ctx.generator, "name", None) or "unknown"
        )
    usage = answer.get("usage") or {}
    sample.metadata["completion_tokens"] = sample.metadata.get("completion_tokens", 0) + int(
        usage.get("completion_tokens", len(token_ids))
    )
    sample.finish_reason = finish
    sample.status = FINISH_STATUS.get(finish, Status.COMPLETED)
    sample.response = decode_response(ctx.tokenizer, sample, cfg.rollout_skip_special_tokens, ctx.eos_token_id)
    if sample.status is Status.ABORTED and not ctx.aborting.is_set():
        return await _continue_after_foreign_abort(ctx, sample, sampling_params)
    return sample


async def _continue_after_foreign_abort(ctx: GenerateContext, sample: Sample, sampling_params: dict) -> Sample:
    """The engine aborted the request, but not for this context: another rollout's or an eval's
    end-of-rollout abort (it aborts every request on the engine), or a publish's pause. The tokens
    so far are kept, with their log-probs and weight versions, and the sample goes on from them; up to
    rollout_request_max_attempts such aborts, then it fails as the infrastructure's (its group is
    generated again)."""
    aborts = int(sample.metadata.get("engine_aborts", 0)) + 1
    sample.metadata["engine_aborts"] = aborts
    if aborts > ctx.cfg.rollout_request_max_attempts:
        return fail_sample(
            sample,
            f"the engine aborted the request {aborts} times (rollout_request_max_attempts="
            f"{ctx.cfg.rollout_request_max_attempts}) without this rollout aborting it",
            retryable=True,
        )
    logger.info("sample %s: aborted by the engine, not by this rollout; continuing it", sample.session_id)
    return await generate_sample(ctx, sample, sampling_params)
