"""The rollout's half of routing replay with the engine stubbed: each request asks for the rows the
sample lacks, the answer's rows (vLLM's `routed_experts` encoding: base64 of `np.save` bytes, as
`vllm.utils.serial_utils.numpy2base64` writes it) are stitched so that rows = len(tokens) - 1 after
every call, across continuations and tool tokens; a malformed answer fails the sample (retryable)
and a retry starts from no rows."""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import re

import numpy as np
import pytest

from tests.unit import test_rollout_loop as loop
from tests.unit.test_rollout_loop import VLLM_0_26_CHOICE, VLLM_0_32_CHOICE, answer
from vime_core.data import routed_experts
from vime_core.data.sample import Sample, Status
from vime_core.engines.client import ROUTED_EXPERTS_START
from vime_core.rollout.generate import GenerateContext, generate_sample
from vime_core.rollout.routing import choice_rows

LAYERS, TOP_K, EXPERTS = 3, 2, 8
make_cfg, tokenizer = loop.make_cfg, loop.tokenizer  # the loop tests' fixtures


def routing_of(tokens: list[int]) -> np.ndarray:
    """The fake engine's routing of a token sequence: row t depends on tokens[: t + 1]."""
    rows = np.zeros((len(tokens), LAYERS, TOP_K), dtype=np.uint8)
    for t in range(len(tokens)):
        first = (sum(tokens[: t + 1]) + 3 * t) % EXPERTS
        for layer in range(LAYERS):
            rows[t, layer] = [(first + layer) % EXPERTS, (first + layer + 1) % EXPERTS]
    return rows


def numpy2base64(rows: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("utf-8")


class RoutingGenerator:
    """Answers `response` (cut to max_tokens) with the rows of every forwarded token from the
    request's routed_experts_prompt_start on, as vLLM does; `mangle` edits the answer."""

    def __init__(self, response=(5, 6, 7), mangle=None):
        self.response, self.mangle, self.calls = list(response), mangle, []

    async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
        self.calls.append((list(token_ids), dict(sampling_params)))
        tokens = self.response[: sampling_params["max_tokens"]]
        out = answer(tokens, finish="stop" if len(tokens) == len(self.response) else "length")
        start = sampling_params[ROUTED_EXPERTS_START]
        forwarded = list(token_ids) + tokens[:-1]  # the last sampled token is never forwarded
        out["choices"][0]["routed_experts"] = numpy2base64(routing_of(forwarded)[start:])
        return self.mangle(out) if self.mangle else out


def _rows(sample: Sample) -> np.ndarray:
    return routed_experts.decode(sample.routed_experts)


def _run(cfg, gen, tokenizer, sample):
    asyncio.run(generate_sample(GenerateContext(cfg, gen, tokenizer, retry_backoff_s=0.001), sample, {}))


def test_a_sample_gets_a_row_per_token_but_the_last_across_continuations_and_tool_tokens(make_cfg, tokenizer):
    cfg = make_cfg(use_rollout_routing_replay=True, use_router=False, rollout_max_response_len=12)
    gen = RoutingGenerator(response=(5, 6, 7))
    s = Sample(tokens=[1, 4, 9], prompt_length=3)
    _run(cfg, gen, tokenizer, s)
    assert gen.calls[0][1][ROUTED_EXPERTS_START] == 0
    assert s.status is Status.COMPLETED and _rows(s).shape == (len(s.tokens) - 1, LAYERS, TOP_K)
    np.testing.assert_array_equal(_rows(s), routing_of(s.tokens)[:-1])

    s.append_response_tokens([11, 12], [0.0, 0.0], loss_mask_value=0)  # a tool's answer: no rows
    held = _rows(s).shape[0]
    s.status = Status.PENDING
    _run(cfg, gen, tokenizer, s)
    assert gen.calls[1][1][ROUTED_EXPERTS_START] == held == len(s.tokens) - 3 - 2 - 1
    np.testing.assert_array_equal(_rows(s), routing_of(s.tokens)[:-1])


@pytest.mark.parametrize("choice", [VLLM_0_26_CHOICE, VLLM_0_32_CHOICE], ids=["vllm-0.26", "vllm-0.32"])
def test_both_releases_choices_carry_the_rows(choice):
    rows = routing_of([1, 2, 3, 4])
    given = {"choices": [dict(copy.deepcopy(choice), routed_experts=numpy2base64(rows))]}
    np.testing.assert_array_equal(choice_rows(given), rows)
    assert choice_rows({"choices": [copy.deepcopy(choice)]}) is None  # "routed_experts": None


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda a: a["choices"][0].pop("routed_experts") and a, "the answer has tokens but no routed_experts"),
        (lambda a: a["choices"][0].update(routed_experts="%%") or a, "routed_experts is not base64"),
        (
            lambda a: a["choices"][0].update(routed_experts=numpy2base64(np.zeros((2, 2), np.uint8))) or a,
            r"routed_experts has shape \(2, 2\)",
        ),
        (
            lambda a: a["choices"][0].update(routed_experts=numpy2base64(np.zeros((1, LAYERS, TOP_K), np.uint8))) or a,
            "routed_experts rows reach token 1, the sample has 6 tokens",
        ),
    ],
)
def test_a_malformed_answer_fails_the_sample_for_a_retry(make_cfg, tokenizer, mangle, message):
    cfg = make_cfg(use_rollout_routing_replay=True, use_router=False)
    s = Sample(tokens=[1, 4, 9], prompt_length=3)
    _run(cfg, RoutingGenerator(mangle=mangle), tokenizer, s)
    assert s.status is Status.FAILED and s.metadata["retryable"] is True
    assert "malformed engine response" in s.metadata["generate_error"]
    assert re.search(message, s.metadata["generate_error"])
    s.clear_response()
    assert s.routed_experts is None


def test_rows_survive_the_data_sources_json_state(make_cfg, tokenizer):
    cfg = make_cfg(use_rollout_routing_replay=True, use_router=False)
    s = Sample(tokens=[1, 4, 9], prompt_length=3)
    _run(cfg, RoutingGenerator(), tokenizer, s)
    back = Sample.from_dict(json.loads(json.dumps(s.to_dict())))
    assert back.routed_experts == s.routed_experts and back.tokens == s.tokens


def test_without_the_flag_nothing_is_asked_or_kept(make_cfg, tokenizer):
    cfg = make_cfg()
    gen = RoutingGenerator()

    async def plain(token_ids, sampling_params, session_id=None, request_id=None):
        gen.calls.append((list(token_ids), dict(sampling_params)))
        return answer([5, 6, 7])

    gen.generate = plain
    s = Sample(tokens=[1, 4, 9], prompt_length=3)
    _run(cfg, gen, tokenizer, s)
    assert ROUTED_EXPERTS_START not in gen.calls[0][1] and s.routed_experts is None and s.status is Status.COMPLETED
