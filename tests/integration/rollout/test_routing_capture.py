"""Routed-experts capture through vime's worker extension on a real vLLM CPU server (tiny Qwen3-MoE,
fp32): per request the rows of every forwarded position (prompt + response - 1), each row the top-k
of transformers' own router on the same tokens, from `routed_experts_prompt_start` on, taken once.
The last test runs an engine of two TP ranks (vLLM's multiprocessing executor, one core per rank):
every rank captures the same rows."""

from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
import torch

from tests.integration.publish.conftest import PROMPT, make_cfg, started_engine
from tests.moe_tiny import tiny_moe_checkpoint
from vime_core.engines.client import (
    ARM_CAPTURE_RPC,
    GENERATE_PATH,
    ROUTED_EXPERTS_START,
    TAKE_ROUTED_EXPERTS_RPC,
    EngineClient,
    EngineError,
)

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def capture_engine(cache_dir, vllm_python):
    ckpt = tiny_moe_checkpoint(cache_dir)
    # use_router: /health stays open for vllm-router's checks (the router test below); the rest is direct
    cfg = make_cfg(ckpt, vllm_python, use_rollout_routing_replay=True, use_router=True)
    with started_engine(cfg, cache_dir / "engine-logs-routing") as server:
        yield server


@pytest.fixture(scope="module")
def tp2_capture_engine(cache_dir, vllm_python):
    """The same checkpoint served by one engine of two TP ranks (vLLM's multiprocessing executor)."""
    ckpt = tiny_moe_checkpoint(cache_dir)
    cfg = make_cfg(
        ckpt,
        vllm_python,
        use_rollout_routing_replay=True,
        use_router=False,
        colocate=False,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=2,
    )
    with started_engine(cfg, cache_dir / "engine-logs-routing-tp2") as server:
        yield server


def decode(b64: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(b64)), allow_pickle=False)


def _generate(engine, prompts: list[list[int]], start: int | list[int] = 0, request_id: str | None = None):
    starts = start if isinstance(start, list) else [start] * len(prompts)

    async def call():
        async with EngineClient(engine.url, token=engine.auth_token) as client:
            params = {"max_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
            return await asyncio.gather(
                *[
                    client.generate(p, dict(params, **{ROUTED_EXPERTS_START: s}), request_id=request_id)
                    for p, s in zip(prompts, starts)
                ]
            )

    return asyncio.run(call())


def _hf_topk(folder, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """transformers' top-k experts [tokens, layers, k] and each row's margin (k-th minus (k+1)-th logit)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    k = model.config.num_experts_per_tok
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    logits = torch.stack([layer.reshape(len(tokens), -1) for layer in out.router_logits], dim=1)
    top = logits.topk(k + 1, dim=-1)
    return top.indices[..., :k].numpy(), (top.values[..., k - 1] - top.values[..., k]).numpy()


def _assert_hf_topk(model_dir, tokens: list[int], rows: np.ndarray, start: int = 0) -> int:
    """`rows` are the engine's rows of `tokens` from position `start` on: [len(tokens) - 1 - start, 2 layers,
    top-2] uint8, k distinct experts each, equal to transformers' top-k where no near tie is; how many compared."""
    assert rows.dtype == np.uint8 and rows.shape == (len(tokens) - 1 - start, 2, 2)
    assert (np.sort(rows, -1)[..., 1:] != np.sort(rows, -1)[..., :-1]).all()  # k distinct experts
    expected, margin = _hf_topk(model_dir, tokens)
    clear = margin[start:-1] > 1e-4  # rows without a near tie; the last token is not forwarded
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(np.sort(rows, -1)[clear], np.sort(expected[start:-1], -1)[clear])
    return int(clear.sum())


def test_rows_are_the_routers_topk_of_every_forwarded_token(capture_engine):
    prompts = [PROMPT, PROMPT[:20], [1] + PROMPT[30:]]
    answers = _generate(capture_engine, prompts)
    compared = 0
    for prompt, answer in zip(prompts, answers):
        choice = answer["choices"][0]
        compared += _assert_hf_topk(
            capture_engine.model_path, prompt + choice["token_ids"], decode(choice["routed_experts"])
        )
    assert compared > 100

    async def stats():
        async with EngineClient(capture_engine.url, token=capture_engine.auth_token) as client:
            return await client.collective_rpc(ARM_CAPTURE_RPC)  # armed already: the layout and the cost so far

    (worker,) = asyncio.run(stats())
    assert (worker["layers"], worker["top_k"], worker["dtype"]) == (2, 2, "uint8")
    assert worker["steps"] >= NEW_TOKENS and 0 < worker["capture_s"] < worker["step_s"]


def test_prompt_start_and_a_continuation_stitch(capture_engine):
    whole = _generate(capture_engine, [PROMPT], 0)[0]["choices"][0]
    rows = decode(whole["routed_experts"])
    # the continuation re-sends prompt + response and asks for the rows it lacks (from len(rows) on)
    tokens = PROMPT + whole["token_ids"]
    more = _generate(capture_engine, [tokens], len(rows))[0]["choices"][0]
    tail = decode(more["routed_experts"])
    assert tail.shape[0] == len(more["token_ids"])  # (P + R - 1) - (P - 1) rows
    stitched = np.concatenate([rows, tail])
    assert stitched.shape[0] == len(tokens) + len(more["token_ids"]) - 1
    # the re-sent tokens route as before (same weights, same prefix): the first call's rows again
    again = decode(_generate(capture_engine, [tokens], 5)[0]["choices"][0]["routed_experts"])
    np.testing.assert_array_equal(again[: len(rows) - 5], rows[5:])


def test_rows_are_taken_once_and_a_bad_start_is_refused(capture_engine):
    request_id = "routing-once"
    _generate(capture_engine, [PROMPT], 0, request_id=request_id)

    async def take():
        async with EngineClient(capture_engine.url, token=capture_engine.auth_token) as client:
            asked = {"request_ids": [request_id], "prompt_starts": [0]}
            return await client.collective_rpc(TAKE_ROUTED_EXPERTS_RPC, asked)

    assert asyncio.run(take())[0][request_id] is None  # the generate took them
    with pytest.raises(EngineError, match="routed_experts_prompt_start"):
        _generate(capture_engine, [PROMPT], len(PROMPT) + 1)


def test_tp2_every_rank_captures_the_routers_topk(tp2_capture_engine):
    engine = tp2_capture_engine
    params = {"max_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}
    short, start = PROMPT[:20], 5

    async def calls():
        async with EngineClient(engine.url, token=engine.auth_token) as client:
            layouts = await client.collective_rpc(ARM_CAPTURE_RPC)
            # a plain generate (no prompt start: the client takes nothing), then each rank's rows
            body = {"token_ids": PROMPT, "sampling_params": params, "request_id": "tp2-plain"}
            plain = await client.request("POST", GENERATE_PATH, json=body)
            per_rank = await client.collective_rpc(
                TAKE_ROUTED_EXPERTS_RPC, {"request_ids": ["tp2-plain"], "prompt_starts": [0], "all_ranks": True}
            )
            # a take as the client makes it: rank 0 answers with the rows, rank 1 drops its copy
            await client.request("POST", GENERATE_PATH, json=dict(body, request_id="tp2-once"))
            once = await client.collective_rpc(
                TAKE_ROUTED_EXPERTS_RPC, {"request_ids": ["tp2-once"], "prompt_starts": [0]}
            )
            taken = await client.generate(short, dict(params, **{ROUTED_EXPERTS_START: start}), request_id="tp2-taken")
            left = await client.collective_rpc(
                TAKE_ROUTED_EXPERTS_RPC,
                {"request_ids": ["tp2-once", "tp2-taken"], "prompt_starts": [0, 0], "all_ranks": True},
            )
            return layouts, plain, per_rank, once, taken, left, await client.collective_rpc(ARM_CAPTURE_RPC)

    layouts, plain, per_rank, once, taken, left, stats = asyncio.run(calls())
    assert [(w["layers"], w["top_k"], w["dtype"]) for w in layouts] == [(2, 2, "uint8")] * 2
    # (a) both ranks captured the request, the same rows
    assert len(per_rank) == 2 and all(r["tp2-plain"] is not None for r in per_rank)
    rank0, rank1 = (decode(r["tp2-plain"]) for r in per_rank)
    np.testing.assert_array_equal(rank0, rank1)
    # (b) they are transformers' top-k
    compared = _assert_hf_topk(engine.model_path, PROMPT + plain["choices"][0]["token_ids"], rank0)
    # (c) EngineClient.generate returns them from the prompt start on, and every rank gave its rows up
    choice = taken["choices"][0]
    compared += _assert_hf_topk(engine.model_path, short + choice["token_ids"], decode(choice["routed_experts"]), start)
    assert compared > 50
    assert once[0]["tp2-once"] is not None and once[1] == {"tp2-once": None}  # one copy moves
    assert left == [{"tp2-once": None, "tp2-taken": None}] * 2  # and neither rank kept its rows
    assert all(w["steps"] >= 2 * NEW_TOKENS and 0 < w["capture_s"] < w["step_s"] for w in stats)


def test_behind_vllm_router_each_answer_carries_its_engines_rows(capture_engine, tmp_path):
    """The fleet's router client (the real vllm-router in front of the engine) arms the engine and
    takes each answer's rows from it: the router does not say which engine answered."""
    from vime_core.engines.fleet import EngineFleet

    fleet = EngineFleet(capture_engine.cfg, servers=[capture_engine])
    try:
        fleet.start(str(tmp_path))
        assert fleet.router is not None and fleet.generator.capture_peers is fleet.clients
        prompts = [PROMPT, PROMPT[:24]]
        params = {"max_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True, ROUTED_EXPERTS_START: 0}
        calls = [fleet.generator.generate(p, dict(params)) for p in prompts]
        answers = [fleet.loop.run(call) for call in calls]
    finally:
        fleet.shutdown()
    compared = sum(
        _assert_hf_topk(
            capture_engine.model_path, p + a["choices"][0]["token_ids"], decode(a["choices"][0]["routed_experts"])
        )
        for p, a in zip(prompts, answers)
    )
    assert compared > 40
