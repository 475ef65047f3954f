"""The default rollout function (`rollout_function_path`, `vime_core.rollout.loop:generate_rollout`):
fills one rollout with groups the trainer can train on, asynchronously, retrying groups the
infrastructure failed and refusing rollouts whose rewards or log-probs cannot be trusted.
RewardFailureError and FilterExhaustedError are ValueErrors: the data, reward function or filter
must change, so the train flow does not retry them (vime_core/faults.py). Every response token
generated is counted once, by where it went, for the compute ledger (rollout/tokens.py)."""

from __future__ import annotations

import asyncio
import collections
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from vime_core.config.derive import rollout_logprob_readers
from vime_core.data.group_rewards import live_rewards
from vime_core.data.sample import Sample, Status
from vime_core.data.validation import UntrainableBatchError, log_probs_error
from vime_core.engines.client import EngineError
from vime_core.ledger import ROLLOUT_TOKENS
from vime_core.rollout.generate import GenerateContext, base_sampling_params, generate_sample
from vime_core.rollout.tokens import RolloutTokens
from vime_core.utils.errors import InfrastructureError
from vime_core.utils.timing import Stopwatch, timed

logger = logging.getLogger(__name__)

ABORT_POLL_S = 0.5
ABORT_WAIT_S = 60.0

GenerateFn = Callable[[GenerateContext, Sample, dict], Awaitable[Sample]]


@dataclass
class RolloutState:
    """What a rollout function works with; built once by the RolloutManager."""

    cfg: Any
    data_source: Any
    reward_hub: Any
    generator: Any  # EngineClient of the router, or a PolicyRouter
    engines: Sequence[Any]  # EngineClient per engine: aborts go to each one directly
    tokenizer: Any
    group_filter: Callable[[list[Sample]], bool]
    eos_token_id: Optional[int] = None
    generate_fn: GenerateFn = generate_sample
    admission_open: Optional[Any] = None  # threading.Event; cleared = hold new requests
    concurrency: int = 1
    # Rollout sample hook: called on each sample after generation and reward.
    sample_hook: Optional[Callable[[Sample], None]] = None
    # Weights the engines serve while this rollout is admitted (set by the RolloutManager); the
    # samples' version where the engine reports none per request (vLLM 0.26).
    weight_version: Optional[int] = None


@dataclass
class _Progress:
    kept: list[list[Sample]] = field(default_factory=list)
    dropped_groups: int = 0
    surplus_groups: int = 0
    submitted_groups: int = 0
    output_tokens: int = 0
    time_reward_s: float = 0.0
    retried_groups: int = 0
    failed_groups: int = 0  # dropped because the engines did not generate them
    failure_reasons: collections.Counter = field(default_factory=collections.Counter)
    gen_batches: int = 0  # batches of over_sampling_batch_size groups submitted
    rejected: list[list[Sample]] = field(default_factory=list)  # kept only for filter_exhausted=keep_rejected
    topped_up: int = 0
    rewards_scored: int = 0  # samples the reward function was called on
    reward_failures: list[tuple[int, int, str]] = field(default_factory=list)  # (group, index, error type)
    tokens: RolloutTokens = field(default_factory=RolloutTokens)  # the compute ledger's counts


class RolloutFailedError(RuntimeError, InfrastructureError):
    """The rollout could not be filled with groups the trainer can train on."""


class RewardFailureError(ValueError):
    """More of a rollout's samples than max_reward_failure_share could not be scored: the reward
    function must be fixed, so it is not retried (a ValueError: faults.py)."""


class FilterExhaustedError(ValueError):
    """max_num_gen_batches batches left the rollout short of groups the dynamic filter keeps: the
    data, the reward or the filter must change, so it is not retried (a ValueError: faults.py)."""


def generate_failure(group: list[Sample]) -> Optional[tuple[str, bool]]:
    """(the first generate error, whether every failure in the group was the infrastructure's),
    or None when the engines generated every sample (a reward function's failure is not one)."""
    failed = [s for s in group if s.status is Status.FAILED and "generate_error" in s.metadata]
    if not failed:
        return None
    return str(failed[0].metadata["generate_error"]), all(s.metadata.get("retryable") for s in failed)


def group_log_probs_error(group: list[Sample], readers: list[str]) -> Optional[str]:
    """The first sample of `group` whose log-probs cannot serve `readers`, in one line, or None."""
    for s in group:
        where = f"sample (group {s.group_index} index {s.index}, prompt {s.prompt_id!r})"
        error = log_probs_error(where, s.rollout_log_probs, s.response_length, s.metadata, readers)
        if error:
            return error
    return None


def _reason_key(reason: str) -> str:
    return reason if len(reason) <= 160 else reason[:157] + "..."


async def wait_for_live_engine(
    engines: Sequence[Any],
    timeout_s: float,
    poll_s: float = 1.0,
    generator: Any = None,
    probe_tokens: Sequence[int] = (),
) -> None:
    """Return once any engine answers /health and, when `generator` is given, a one-token
    generate of `probe_tokens` goes through it: vllm-router keeps a restarted engine's circuit
    open for a while after the engine answers /health, and a group sent in that window fails
    again without reaching it. RolloutFailedError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    names = ", ".join(str(getattr(e, "name", e)) for e in engines)
    while True:
        answers = await asyncio.gather(*(e.is_healthy(timeout_s=5.0) for e in engines), return_exceptions=True)
        if any(a is True for a in answers):
            break
        if time.monotonic() >= deadline:
            raise RolloutFailedError(
                f"no engine answered /health within rollout_engine_wait_s={timeout_s:g} s (engines: {names})"
            )
        await asyncio.sleep(poll_s)
    if generator is None or not probe_tokens:
        return
    while True:
        try:
            await generator.generate(list(probe_tokens), {"max_tokens": 1, "temperature": 0.0})
            return
        except EngineError as exc:
            if exc.status is not None and exc.status < 500:
                return  # the request reached an engine, which refused it: routing works
            if time.monotonic() >= deadline:
                raise RolloutFailedError(
                    f"the engines answer /health but no request got through {getattr(generator, 'name', 'the router')} "
                    f"within rollout_engine_wait_s={timeout_s:g} s (engines: {names}; last: {exc})"
                ) from None
        await asyncio.sleep(poll_s)


async def _handle_failed_group(
    state: "RolloutState",
    rollout_id: int,
    group: list[Sample],
    failure: tuple[str, bool],
    progress: _Progress,
    needed: bool,
) -> Optional[list[Sample]]:
    """The group to submit in the place of a group the engines failed, or None.

    When the engines failed it (engine died, connection reset) it is generated again once an engine
    answers /health and a one-token request gets through the router, up to rollout_group_max_attempts
    in all; then (or at once, for a bad request) it is dropped and one new group takes its place.
    `needed` (the groups kept and in flight fall short of the batch): the group (or its replacement)
    is returned to be submitted at once, outside max_num_gen_batches, which bounds what the dynamic
    filter rejects, not what the infrastructure failed; otherwise a retried group goes back to the data
    source for a later rollout and a dropped one is not replaced. More dropped groups than the batch
    holds, or no live engine within rollout_engine_wait_s: RolloutFailedError, naming the engines and
    the reasons."""
    cfg = state.cfg
    reason, retryable = failure
    progress.failure_reasons[_reason_key(reason)] += 1
    attempts = int(group[0].metadata.get("group_attempts", 1))
    if retryable and attempts < cfg.rollout_group_max_attempts:
        logger.warning(
            "rollout %d: group %d failed (%s); generating it again (attempt %d of %d)",
            rollout_id,
            group[0].group_index,
            reason,
            attempts + 1,
            cfg.rollout_group_max_attempts,
        )
        for sample in group:
            sample.clear_response()
            sample.metadata["group_attempts"] = attempts + 1
        progress.retried_groups += 1
        if not needed:
            state.data_source.add_back([group])
            return None
        prompt = group[0].tokens[: group[0].prompt_length or len(group[0].tokens)]
        await wait_for_live_engine(
            state.engines, cfg.rollout_engine_wait_s, generator=state.generator, probe_tokens=prompt
        )
        return group
    progress.failed_groups += 1
    logger.warning(
        "rollout %d: group %d dropped after %d attempt(s): %s", rollout_id, group[0].group_index, attempts, reason
    )
    if progress.failed_groups > cfg.rollout_batch_size:
        names = ", ".join(str(getattr(e, "name", e)) for e in state.engines)
        reasons = "; ".join(f"{n} x {r}" for r, n in progress.failure_reasons.most_common(3))
        raise RolloutFailedError(
            f"rollout {rollout_id}: {progress.failed_groups} groups could not be generated, more than the batch's "
            f"{cfg.rollout_batch_size} (engines: {names}; reasons: {reasons})"
        )
    return state.data_source.get_groups(1)[0] if needed else None


async def _run_sample(
    state: RolloutState,
    ctx: GenerateContext,
    sem: asyncio.Semaphore,
    sample: Sample,
    params: dict,
    progress: _Progress,
    bar: Any,
) -> Sample:
    async with sem:
        before = sample.response_length
        await state.generate_fn(ctx, sample, dict(params))
    progress.output_tokens += sample.response_length - before
    progress.tokens.add(sample, sample.response_length - before)
    if not state.cfg.group_rm and sample.status in (Status.COMPLETED, Status.TRUNCATED):
        with timed() as scoring:
            await state.reward_hub.score(sample)
        progress.time_reward_s += scoring.seconds
        _count_scored(progress, [sample])
    if sample.status is not Status.ABORTED:
        bar.update(1)
    return sample


async def _run_group(
    state: RolloutState,
    ctx: GenerateContext,
    sem: asyncio.Semaphore,
    group: list[Sample],
    params: dict,
    progress: _Progress,
    bar: Any,
) -> list[Sample]:
    samples = await asyncio.gather(*(_run_sample(state, ctx, sem, s, params, progress, bar) for s in group))
    if state.cfg.group_rm and not any(s.status is Status.ABORTED for s in samples):
        scorable = [s for s in samples if s.status in (Status.COMPLETED, Status.TRUNCATED)]
        with timed() as scoring:
            await state.reward_hub.score_group(scorable)
        progress.time_reward_s += scoring.seconds
        _count_scored(progress, scorable)
    for s in samples:
        if s.status is Status.FAILED and s.reward is None:
            s.reward = 0.0
        if state.sample_hook is not None:
            state.sample_hook(s)
    return list(samples)


def _count_scored(progress: _Progress, scored: list[Sample]) -> None:
    """Count samples the reward function was just called on, and its failures by sample index
    and error type (metadata["reward_error_type"], set by the hub: never the value)."""
    progress.rewards_scored += len(scored)
    for s in scored:
        if s.status is Status.FAILED:
            what = str(s.metadata.get("reward_error_type", "error"))
            progress.reward_failures.append((s.group_index, s.index, what))


def _percent(share: float) -> str:
    return f"{share * 100:.3g}%"


def check_reward_failures(state: RolloutState, rollout_id: int, progress: _Progress) -> None:
    """Reward failures in one line per rollout: a warning, or RewardFailureError when
    share = failed / scored > max_reward_failure_share, over every sample scored in this rollout, kept
    or not. Either names the reward function, the counts and the first failures' sample indices and
    exception types, never a value, a prompt or a response (they may be private)."""
    failures = progress.reward_failures
    if not failures:
        return
    cfg = state.cfg
    scored = progress.rewards_scored
    share = len(failures) / scored
    first = ", ".join(f"{what} at group {g} sample {i}" for g, i, what in sorted(failures)[:3])
    name = getattr(state.reward_hub, "name", None) or cfg.custom_rm_path or cfg.rm_type
    counts = f"the reward function {name} failed on {len(failures)} of {scored} samples"
    if share > cfg.max_reward_failure_share:
        raise RewardFailureError(
            f"rollout {rollout_id}: {counts} ({_percent(share)} > max_reward_failure_share="
            f"{_percent(cfg.max_reward_failure_share)}): first failures {first}; fix the reward function (each "
            f"FAILED sample's metadata reward_error holds its message) or raise max_reward_failure_share"
        )
    logger.warning(
        "rollout %d: %s (%s, max_reward_failure_share=%s): they are FAILED (loss mask 0); first failures %s",
        rollout_id,
        counts,
        _percent(share),
        _percent(cfg.max_reward_failure_share),
        first,
    )


def _filter_name(state: RolloutState) -> str:
    fn = state.group_filter
    path = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', fn)}"
    return state.cfg.dynamic_sampling_filter_path or path


def fill_exhausted(state: RolloutState, rollout_id: int, progress: _Progress) -> None:
    """max_num_gen_batches batches submitted and answered, fewer than rollout_batch_size groups
    kept: filter_exhausted=keep_rejected tops the kept groups up with the earliest groups the filter
    rejected; otherwise, or when too few were rejected, FilterExhaustedError naming the filter and the
    counts (RolloutFailedError when the filter rejected nothing: the engines did not generate them)."""
    cfg = state.cfg
    target = cfg.rollout_batch_size
    short = target - len(progress.kept)
    if cfg.filter_exhausted == "keep_rejected" and len(progress.rejected) >= short:
        topped = sorted(progress.rejected, key=lambda g: g[0].group_index)[:short]
        progress.kept.extend(topped)
        progress.tokens.take_back(topped)
        progress.topped_up = short
        logger.warning(
            "rollout %d: the dynamic filter %s kept %d of rollout_batch_size=%d groups in "
            "max_num_gen_batches=%d batches; topped up with %d groups it rejected (filter_exhausted="
            "keep_rejected)",
            rollout_id,
            _filter_name(state),
            target - short,
            target,
            cfg.max_num_gen_batches,
            short,
        )
        return
    answered = len(progress.kept) + progress.dropped_groups
    counts = (
        f"kept {len(progress.kept)} of the {answered} groups answered ({progress.dropped_groups} rejected, "
        f"{progress.failed_groups} more not generated; {progress.submitted_groups} submitted in "
        f"max_num_gen_batches={cfg.max_num_gen_batches} batches of over_sampling_batch_size="
        f"{cfg.over_sampling_batch_size}), short of rollout_batch_size={target}"
    )
    if progress.dropped_groups == 0 and progress.failed_groups > 0:
        names = ", ".join(str(getattr(e, "name", e)) for e in state.engines)
        reasons = "; ".join(f"{n} x {r}" for r, n in progress.failure_reasons.most_common(3))
        raise RolloutFailedError(f"rollout {rollout_id}: the rollout {counts} (engines: {names}; reasons: {reasons})")
    also = (
        f"; filter_exhausted=keep_rejected had only {len(progress.rejected)} rejected groups to top up with"
        if cfg.filter_exhausted == "keep_rejected"
        else ""
    )
    name = _filter_name(state)
    why = " (groups whose rewards are all equal)" if name.endswith(":check_reward_nonzero_std") else ""
    raise FilterExhaustedError(
        f"rollout {rollout_id}: the dynamic filter {name} {counts}{also}: the data or the reward gives groups it "
        f"rejects{why}; check the reward function and the data, raise max_num_gen_batches, or set "
        f"filter_exhausted=keep_rejected to train on rejected groups"
    )


def _group_is_complete(group: list[Sample]) -> bool:
    return not any(s.status in (Status.ABORTED, Status.PENDING) for s in group)


async def abort_in_flight(
    engines: Sequence[Any], tasks: set[asyncio.Task], ctx: GenerateContext, wait_s: float = ABORT_WAIT_S
) -> None:
    """Stop every request still running and wait for its task; requests already on an engine
    come back with finish "abort", those not sent yet return ABORTED without a request."""
    ctx.aborting.set()
    deadline = time.monotonic() + wait_s
    while tasks and time.monotonic() < deadline:
        await asyncio.gather(*(_abort_quietly(e) for e in engines))
        done, tasks = await asyncio.wait(tasks, timeout=ABORT_POLL_S)
    for task in tasks:  # an engine that never answers must not hang the rollout
        task.cancel()
    if tasks:
        logger.warning("%d group tasks did not finish %.0f s after the abort; cancelled", len(tasks), wait_s)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _abort_quietly(engine: Any) -> None:
    try:
        await engine.abort_requests()
    except Exception as exc:  # a dead engine has nothing in flight to abort
        logger.info("abort_requests on %s failed: %s", getattr(engine, "name", engine), exc)


def requeue_partial(data_source: Any, groups: list[list[Sample]]) -> int:
    """Give unfinished groups back with their partial responses; what was generated so far is
    off-policy for the next rollout, so its loss mask becomes 0. A FAILED sample (its reward or
    its generation failed) goes back as its prompt alone, to be generated again: continuing it would
    append to a finished response, after its EOS. Returns the sample count."""
    for group in groups:
        for s in group:
            if s.status is Status.FAILED:
                s.clear_response()
            s.loss_mask = [0] * len(s.loss_mask)
            if s.status is Status.ABORTED:
                s.status = Status.PENDING
            s.metadata["requeued"] = s.metadata.get("requeued", 0) + 1
    data_source.add_back(groups)
    return sum(len(g) for g in groups)


def rollout_metrics(
    groups: list[list[Sample]], progress: _Progress, aborted: int, requeued: int, times: dict[str, float]
) -> dict[str, float]:
    samples = [s for g in groups for s in g]
    # the rewards that count: a FAILED sample's 0.0 placeholder would drag the mean the run guard watches
    rewards = live_rewards(samples)
    lengths = [s.response_length for s in samples]
    completed_groups = len(progress.kept) - progress.topped_up + progress.dropped_groups
    gen_s = times.get("rollout/time_generate_s", 0.0)
    return {
        "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "rollout/response_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "rollout/response_len_max": float(max(lengths, default=0)),
        "rollout/truncated_rate": sum(s.status is Status.TRUNCATED for s in samples) / max(1, len(samples)),
        "rollout/failed_count": float(sum(s.status is Status.FAILED for s in samples)),
        # over every sample scored in the rollout, the groups the filter dropped included
        "rollout/reward_failed_count": float(len(progress.reward_failures)),
        "rollout/reward_failure_share": len(progress.reward_failures) / max(1, progress.rewards_scored),
        "rollout/filter_drop_rate": progress.dropped_groups / max(1, completed_groups),
        "rollout/dropped_groups": float(progress.dropped_groups),
        "rollout/surplus_groups": float(progress.surplus_groups),
        "rollout/retried_groups": float(progress.retried_groups),
        "rollout/failed_groups": float(progress.failed_groups),
        "rollout/submitted_groups": float(progress.submitted_groups),
        "rollout/gen_batches": float(progress.gen_batches),
        "rollout/filter_topped_up": float(progress.topped_up),
        "rollout/aborted_count": float(aborted),
        "rollout/requeued_count": float(requeued),
        "rollout/missing_logprob_count": float(sum(s.metadata.get("missing_logprobs", 0) for s in samples)),
        "rollout/output_tokens": float(progress.output_tokens),
        "rollout/generate_tokens_per_s": progress.output_tokens / gen_s if gen_s > 0 else 0.0,
        "rollout/time_reward_s": progress.time_reward_s,
        **times,
    }


async def generate_rollout(state: RolloutState, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
    """One rollout: exactly rollout_batch_size groups (contiguous, samples in index order, each with a
    response) and the rollout's metrics, called as `await fn(state, rollout_id)`.

        while kept < rollout_batch_size:
            submit batches of over_sampling_batch_size groups while kept + in flight < target and
                fewer than max_num_gen_batches were submitted;
                a semaphore of vllm_server_concurrency * engines bounds the requests in flight
            take the first group that completes: score it (group_rm; else each sample was scored
                after its generation), apply the dynamic filter -> kept / dropped; a group the
                engines failed goes to `_handle_failed_group`, which gives the group (retried) or one
                new group (dropped) to submit in its place; a sample lacking log-probs a set flag
                reads stops the rollout (UntrainableBatchError, not retried)
            nothing in flight: exhausted -> `fill_exhausted`
        abort what still runs; partial_rollout gives unfinished groups back to the data source with
        their partial responses (the off-policy part masked), otherwise they are dropped
        `check_reward_failures`

    A rollout that raises hands nothing on; the RolloutManager puts its data source back, so its
    prompts are drawn again."""
    from tqdm.auto import tqdm

    cfg = state.cfg
    target = cfg.rollout_batch_size
    since = Stopwatch()  # the marks t_* below: seconds since the rollout began
    ctx = GenerateContext(
        cfg,
        state.generator,
        state.tokenizer,
        state.eos_token_id,
        admission_open=state.admission_open,
        weight_version=state.weight_version,
    )
    sem = asyncio.Semaphore(state.concurrency)
    params = base_sampling_params(cfg)
    readers = rollout_logprob_readers(cfg)
    progress = _Progress()
    in_flight: set[asyncio.Task] = set()
    all_tasks: list[asyncio.Task] = []
    bar = tqdm(total=target * cfg.n_samples_per_prompt, desc=f"rollout {rollout_id}", unit="sample", disable=None)

    def submit(group: list[Sample]) -> None:
        task = asyncio.create_task(_run_group(state, ctx, sem, group, params, progress, bar))
        in_flight.add(task)
        all_tasks.append(task)
        progress.submitted_groups += 1

    try:
        while len(progress.kept) < target:
            while len(progress.kept) + len(in_flight) < target and progress.gen_batches < cfg.max_num_gen_batches:
                progress.gen_batches += 1
                for group in state.data_source.get_groups(cfg.over_sampling_batch_size):
                    submit(group)
            if not in_flight:
                break  # max_num_gen_batches submitted and answered: exhausted (fill_exhausted)
            done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                group = task.result()
                if len(group) != cfg.n_samples_per_prompt:
                    raise RuntimeError(
                        (
                            f"group {group[0].group_index if group else '?'} has {len(group)} samples; "
                            f"n_samples_per_prompt={cfg.n_samples_per_prompt}"
                        )
                    )
                failure = generate_failure(group)
                if failure is not None:
                    progress.tokens.discard("generate_failed", group)
                    if len(progress.kept) < target:
                        needed = len(progress.kept) + len(in_flight) < target
                        again = await _handle_failed_group(state, rollout_id, group, failure, progress, needed)
                        if again is not None:
                            submit(again)
                    continue
                error = group_log_probs_error(group, readers)
                if error:
                    raise UntrainableBatchError(f"rollout {rollout_id}: {error}")
                if len(progress.kept) >= target:
                    progress.surplus_groups += 1
                    progress.tokens.discard("surplus", group)
                elif state.group_filter(group):
                    progress.kept.append(group)
                else:
                    progress.dropped_groups += 1
                    progress.tokens.discard("filter", group)
                    if cfg.filter_exhausted == "keep_rejected":
                        progress.rejected.append(group)
        t_generated = since.seconds

        leftovers: list[list[Sample]] = []
        if in_flight:
            abort_tasks = set(in_flight)
            await abort_in_flight(state.engines, abort_tasks, ctx)
            finished = [t for t in in_flight if not t.cancelled() and t.exception() is None]
            leftovers = sorted((t.result() for t in finished), key=lambda g: g[0].group_index)
        t_aborted = since.seconds
    except BaseException:
        ctx.aborting.set()  # a failing group must not leave requests running behind it
        for task in all_tasks:
            task.cancel()
        await asyncio.gather(*all_tasks, return_exceptions=True)  # retrieve every outcome
        raise
    finally:
        bar.close()

    aborted = sum(s.status is Status.ABORTED for g in leftovers for s in g)
    requeued = 0
    unfinished = [g for g in leftovers if not _group_is_complete(g)]
    for group in (g for g in leftovers if _group_is_complete(g)):  # finished beside the abort
        progress.tokens.discard("surplus", group)
    if cfg.partial_rollout and unfinished:
        requeued = requeue_partial(state.data_source, unfinished)
    check_reward_failures(state, rollout_id, progress)  # first: a failing reward also empties the filter
    if len(progress.kept) < target:
        fill_exhausted(state, rollout_id, progress)

    groups = sorted(progress.kept[:target], key=lambda g: g[0].group_index)
    samples = [s for g in groups for s in sorted(g, key=lambda s: s.index)]
    t_end = since.seconds
    times = {
        "rollout/time_generate_s": t_generated,
        "rollout/time_abort_s": t_aborted - t_generated,
        "rollout/time_finalize_s": t_end - t_aborted,
        "rollout/time_total_s": t_end,
    }
    metrics = rollout_metrics(groups, progress, aborted, requeued, times)
    metrics[ROLLOUT_TOKENS] = progress.tokens.close(samples)  # the rest was cut by the abort
    logger.info(
        "rollout %d: %d groups, reward %.3f, %.0f tok/s",
        rollout_id,
        len(groups),
        metrics["rollout/reward_mean"],
        metrics["rollout/generate_tokens_per_s"],
    )
    return samples, metrics
