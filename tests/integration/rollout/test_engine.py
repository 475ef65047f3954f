"""One real vLLM server: token-in/token-out, log-prob parity with transformers, pause(keep)
across a weight swap, bad input. The two real servers behind the real vllm-router: load spread
and session affinity."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from vime_core.engines.auth import auth_headers
from vime_core.engines.client import EngineClient, EngineError, SyncEngineClient

from tests.integration.rollout.conftest import ENGINE_CONTEXT, ENGINE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPT = [1, 5, 14, 6, 17]  # "<bos>2+3="
TEMPERATURE = 0.7
# fp32 engine vs fp32 transformers on the same weights: only summation order differs.
# The difference is far below this bound on this model; the bound leaves room for kernels.
LOGPROB_ATOL = 1e-3
# A request the engine finishes before the pause reaches it cannot show a split; see the test.
ATTEMPTS_FOR_A_SPLIT = 5


def run(coro):
    return asyncio.run(coro)


async def generate(url: str, token_ids: list[int], *, token=None, **params) -> dict:
    async with EngineClient(url, token=token) as client:
        sampling = {"temperature": TEMPERATURE, "top_k": -1, "top_p": 1.0, "logprobs": 0, **params}
        return await client.generate(token_ids, sampling)


def reference_logprobs(model_dir: Path, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of a transformers forward, at each sampled response token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(response) - 1)
    return [float(logp[p, t]) for p, t in zip(positions, response)]


def test_token_in_token_out_and_logprob_parity(healthy_engines, tiny_model_dir):
    url = healthy_engines[0].url
    answer = run(generate(url, PROMPT, max_tokens=12, ignore_eos=True, token=healthy_engines[0].auth_token))
    choice = answer["choices"][0]
    tokens = choice["token_ids"]
    assert len(tokens) == 12 and all(0 <= t < 19 for t in tokens)
    assert answer["usage"]["completion_tokens"] == 12 and answer["usage"]["prompt_tokens"] == len(PROMPT)
    engine = [e["logprob"] for e in choice["logprobs"]["content"]]
    reference = reference_logprobs(tiny_model_dir, PROMPT, tokens, TEMPERATURE)
    diff = max(abs(a - b) for a, b in zip(engine, reference))
    print(f"max |engine - transformers| log-prob at T={TEMPERATURE}: {diff:.2e}")
    assert diff < LOGPROB_ATOL
    # Processed (tempered) log-probs, not raw ones: at T=1 they would differ by far more.
    raw = reference_logprobs(tiny_model_dir, PROMPT, tokens, 1.0)
    assert max(abs(a - b) for a, b in zip(engine, raw)) > 10 * LOGPROB_ATOL


def test_vllm_env_reaches_the_server_processes(healthy_engines):
    """vllm_env is in the environment of the orphan guard and of vLLM's front end under it (the
    process that reads VLLM_WORKER_MULTIPROC_METHOD), not only in the command vime builds. The
    processes vLLM renames (VLLM::EngineCore, VLLM::Worker) are left out: setproctitle writes
    their title over the memory /proc/<pid>/environ shows."""
    import psutil

    name, value = ENGINE_ENV.split("=")
    for server in healthy_engines:
        guard = psutil.Process(server._proc.pid)
        processes = [guard, *(p for p in guard.children(recursive=True) if not p.name().startswith("VLLM::"))]
        assert any("vime_core.engines.vllm_side.api_server" in p.cmdline() for p in processes)
        assert all(p.environ().get(name) == value for p in processes), [(p.pid, p.cmdline()[:3]) for p in processes]


# vLLM 0.32's CPU build prints this once per interpreter that imports it
VLLM_IMPORT_NOTICE = "Triton is installed, but doesn't include CPU backend"


def test_a_one_rank_cpu_engine_imports_vllm_once(healthy_engines):
    """The engine core of a one-rank CPU engine is forked from the API server (vllm_side/api_server.py),
    which imported vLLM already; a spawned one (vLLM's CPU default) imports it again, seconds of each start."""
    for server in healthy_engines:
        assert server.cpu_cores() is not None  # one rank, one engine-core process
        log = server.log_path.read_text(errors="replace")
        assert "EngineCore pid=" in log and log.count(VLLM_IMPORT_NOTICE) == 1, log.count(VLLM_IMPORT_NOTICE)


def _perturbed_checkpoint(model_dir: Path, out_dir: Path) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    changed = {
        k: (v + 0.5 * torch.randn(v.shape, generator=gen)).contiguous() if v.ndim == 2 else v
        for k, v in tensors.items()
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(changed, str(out_dir / "model.safetensors"))
    return out_dir


def _swap_weights(client: SyncEngineClient, weights_dir: Path, version: int) -> None:
    client.collective_rpc("reload_weights", {"weights_path": str(weights_dir)})
    client.update_weight_version(version)
    client.reset_prefix_cache()


async def _stream_generate(url: str, token_ids: list[int], on_first_tokens, token=None, **params) -> dict:
    """Stream `/inference/v1/generate` (SSE) and await `on_first_tokens()` as soon as the first
    chunk with tokens arrives; returns the concatenated tokens and the final chunk's
    weight_versions (vLLM sets them on the last chunk only)."""
    body = {
        "token_ids": token_ids,
        "stream": True,
        "sampling_params": {"temperature": TEMPERATURE, "top_k": -1, "top_p": 1.0, **params},
    }
    tokens: list[int] = []
    spans = None
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{url}/inference/v1/generate", json=body, headers=auth_headers(token)) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[len("data: ") :])["choices"][0]
                first = not tokens
                tokens += choice.get("token_ids") or []
                spans = choice.get("weight_versions") or spans
                if first and tokens:
                    await on_first_tokens()
    return {"token_ids": tokens, "weight_versions": spans}


def test_pause_keep_across_weight_swap_gives_two_version_spans(healthy_engines, tiny_model_dir, tmp_path):
    """The trigger is the request's own first streamed tokens, not a timer: the pause is sent
    after token 1. The engine keeps decoding until the pause reaches it, and on a fast host the
    tiny model can finish all ~250 tokens first; such an attempt shows one span of the old
    version, proves nothing either way, and is tried again (a pause that never splits a request
    fails every attempt)."""
    server = healthy_engines[0]
    sync = SyncEngineClient(server.url, token=server.auth_token)
    new_weights = _perturbed_checkpoint(tiny_model_dir, tmp_path / "v1")
    max_tokens = ENGINE_CONTEXT - len(PROMPT) - 1
    old_versions = ("default", "0")  # a fresh server says "default"; one an earlier test swapped says "0"

    def one_attempt() -> list[dict]:
        frozen_at: list[int] = []

        async def generate_with_a_swap() -> dict:
            # the client is open before the request starts, so the pause is one call away
            async with EngineClient(server.url, token=server.auth_token) as client:

                async def swap_while_frozen() -> None:
                    await client.pause("keep")
                    assert await client.is_paused()
                    await asyncio.to_thread(_swap_weights, sync, new_weights, 1)
                    frozen_at.append(1)
                    await client.resume()

                return await _stream_generate(
                    server.url, PROMPT, swap_while_frozen, server.auth_token, max_tokens=max_tokens, ignore_eos=True
                )

        try:
            answer = run(generate_with_a_swap())
        finally:
            _swap_weights(sync, tiny_model_dir, 0)
        assert frozen_at and len(answer["token_ids"]) == max_tokens
        return answer["weight_versions"]

    attempts = []
    for _ in range(ATTEMPTS_FOR_A_SPLIT):
        spans = one_attempt()
        attempts.append(spans)
        finished_before_the_pause = (
            len(spans) == 1 and spans[0]["version"] in old_versions and spans[0]["end"] == max_tokens
        )
        if not finished_before_the_pause:
            break
    print(f"weight-version spans of a {max_tokens}-token request paused after its first chunk, per attempt: {attempts}")
    assert len(spans) == 2 and spans[0]["version"] in old_versions and spans[1]["version"] == "1", attempts
    assert spans[0]["start"] == 0 and 0 < spans[0]["end"] == spans[1]["start"] < max_tokens, spans
    assert spans[1]["end"] == max_tokens
    assert sync.weight_version() == 0


def test_bad_input_prompt_longer_than_context(healthy_engines):
    from tests.integration.rollout.conftest import ENGINE_CONTEXT

    with pytest.raises(EngineError) as err:
        run(
            generate(
                healthy_engines[0].url, [3] * (ENGINE_CONTEXT + 10), max_tokens=4, token=healthy_engines[0].auth_token
            )
        )
    assert err.value.status == 400 and err.value.endpoint == "POST /inference/v1/generate"
    assert str(ENGINE_CONTEXT) in err.value.body


def test_unreachable_engine_is_a_clear_error_not_a_hang():
    from vime_core.engines.server import free_port

    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        run(generate(url, PROMPT, max_tokens=4))
    assert err.value.status is None and "Connect" in err.value.body
    assert time.monotonic() - t0 < 5


def _requests_served(url: str, token) -> float:
    text = httpx.get(f"{url}/metrics", headers=auth_headers(token), timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


@pytest.mark.parametrize("policy", ["round_robin", "consistent_hash"])
def test_router_spreads_load_and_keeps_sessions(healthy_engines, cache_dir, policy):
    from vime_core.engines.router import Router

    urls = [s.url for s in healthy_engines]
    token = healthy_engines[0].auth_token  # the engines' one token: the router forwards it
    router = Router(policy, worker_urls=urls, log_dir=str(cache_dir / "engine-logs"))
    router.start()
    try:
        deadline = time.monotonic() + 60
        while set(router.workers()) != set(urls) and time.monotonic() < deadline:
            time.sleep(0.2)

        async def burst(session_ids: list[str]) -> list[dict]:
            async with EngineClient(router.url, "router", token=token) as client:
                params = {"max_tokens": 4, "temperature": 1.0, "logprobs": 0}
                return await asyncio.gather(*(client.generate(PROMPT, params, session_id=s) for s in session_ids))

        before = [_requests_served(u, token) for u in urls]
        answers = run(burst([f"s-{i}" for i in range(16)]))
        spread = [_requests_served(u, token) - b for u, b in zip(urls, before)]
        assert sum(spread) == 16 and all(n > 0 for n in spread), spread
        assert all(len(a["choices"][0]["logprobs"]["content"]) == len(a["choices"][0]["token_ids"]) for a in answers)
        if policy == "consistent_hash":
            for session in ("alpha", "beta", "gamma"):
                before = [_requests_served(u, token) for u in urls]
                run(burst([session] * 6))
                counts = sorted(_requests_served(u, token) - b for u, b in zip(urls, before))
                assert counts == [0, 6], f"session {session} split over engines: {counts}"
    finally:
        router.shutdown()


def test_attach_checks_parallel_size(healthy_engines, tiny_model_dir, vllm_python):
    from tests.integration.rollout.conftest import make_cfg
    from vime_core.engines.server import EngineServer

    url, token = healthy_engines[0].url, healthy_engines[0].auth_token
    ok = EngineServer(make_cfg(tiny_model_dir, vllm_python, engine_urls=[url]), 0, attach_url=url, token=token)
    assert ok.start() == url
    ok.shutdown()  # attached: must leave the server running
    assert healthy_engines[0].is_alive()
    cfg = make_cfg(tiny_model_dir, vllm_python, engine_urls=[url], rollout_num_gpus_per_engine=2)
    with pytest.raises(ValueError, match=r"TP x PP = 1, but rollout_num_gpus_per_engine=2"):
        EngineServer(cfg, 0, attach_url=url, token=token).start()


def test_the_engine_log_says_where_its_start_went(healthy_engines):
    """A real start leaves vime's launch line and vLLM's milestones in the engine's log: the
    seconds to its arguments and to serving, in launch order, within the time it took."""
    server = healthy_engines[0]
    marks = server.startup_marks()
    assert marks["launched_epoch"] is not None and marks["launched_epoch"] <= time.time()
    seconds = marks["marks_s"]
    assert {"args", "serving"} <= set(seconds), seconds
    assert 0 < seconds["args"] <= seconds["serving"] <= time.time() - marks["launched_epoch"]


def test_detokenize_false_gives_the_same_tokens_without_text(healthy_engines):
    """What a rollout sends without stop strings (rollout/generate.request_params): the server
    skips its detokenizer and still returns every token and log-prob, as with text."""
    url, token = healthy_engines[0].url, healthy_engines[0].auth_token
    with_text = run(generate(url, PROMPT, temperature=0.0, max_tokens=6, detokenize=True, token=token))
    without = run(generate(url, PROMPT, temperature=0.0, max_tokens=6, detokenize=False, token=token))
    a, b = with_text["choices"][0], without["choices"][0]
    assert a["token_ids"] and a["token_ids"] == b["token_ids"]
    assert len(b["logprobs"]["content"]) == len(b["token_ids"])


def test_two_front_ends_share_one_engine(tiny_model_dir, vllm_python, tmp_path):
    """vllm_api_server_count 2: `vllm serve` with two HTTP front-end processes on one port and
    one engine. Requests on fresh connections (spread over both by the kernel) all generate;
    the control calls vime makes through one front end (pause, weight version, resume) act on
    the engine every front end serves, so no answer carries another version."""
    from vime_core.engines.server import EngineServer
    from tests.integration.rollout.conftest import make_cfg

    cfg = make_cfg(tiny_model_dir, vllm_python, vllm_api_server_count=2)
    server = EngineServer(cfg, 0, engines_per_node=1, log_dir=str(tmp_path))
    url = server.start()
    group = server._proc.pid  # its own session: the front ends and the engine are in its group
    try:
        log = server.log_path.read_text(errors="replace")
        front_ends = set(re.findall(r"\((?:APIServer|ApiServer_\d+) pid=(\d+)\)", log))
        assert len(front_ends) >= 2, f"one front end in the log: {front_ends}"

        async def on_fresh_connections(count: int) -> list[dict]:
            async def one(i: int) -> dict:
                async with EngineClient(url, token=server.auth_token) as client:  # a new connection each
                    return await client.generate(PROMPT, {"temperature": 1.0, "max_tokens": 4, "seed": i})

            return await asyncio.gather(*(one(i) for i in range(count)))

        assert all(a["choices"][0]["token_ids"] for a in run(on_fresh_connections(8)))
        sync = SyncEngineClient(url, token=server.auth_token)
        sync.pause("keep")
        sync.update_weight_version(7)
        sync.resume()
        answers = run(on_fresh_connections(8))
        versions = {span["version"] for a in answers for span in a["choices"][0]["weight_versions"]}
        assert versions == {"7"}, versions
        assert all(SyncEngineClient(url, token=server.auth_token).weight_version() == 7 for _ in range(4))
    finally:
        server.shutdown()
    deadline = time.monotonic() + 30
    while _group_alive(group):  # every front end stops with the server
        assert time.monotonic() < deadline, f"processes of group {group} outlived the shutdown"
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    import os

    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_sample_the_engine_aborts_for_someone_else_goes_on_from_its_tokens(
    healthy_engines, tiny_model_dir, vllm_python
):
    """vLLM's /abort_requests ends every request on the engine, a rollout's or not. A sample whose
    own context is not aborting keeps what the aborted request generated (its tokens, log-probs and
    weight version) and is continued to its full length. The abort is sent a moment after the
    request: too early (nothing running yet) or too late (the tiny model finished first) shows no
    abort and proves nothing, so the attempt is tried again with another delay."""
    from transformers import AutoTokenizer

    from tests.integration.rollout.conftest import make_cfg
    from vime_core.data.sample import Sample, Status
    from vime_core.rollout.generate import GenerateContext, base_sampling_params, generate_sample

    server = healthy_engines[0]
    budget = ENGINE_CONTEXT - len(PROMPT) - 1
    cfg = make_cfg(tiny_model_dir, vllm_python, rollout_max_response_len=budget, use_tis=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    params = {**base_sampling_params(cfg), "ignore_eos": True}

    async def one_attempt(delay_s: float) -> Sample:
        sample = Sample(tokens=list(PROMPT), prompt_length=len(PROMPT), session_id="foreign-abort-0-0")
        async with (
            EngineClient(server.url, token=server.auth_token) as client,
            EngineClient(server.url, token=server.auth_token) as other,
        ):
            ctx = GenerateContext(cfg, client, tokenizer, tokenizer.eos_token_id)
            task = asyncio.create_task(generate_sample(ctx, sample, params))
            await asyncio.sleep(delay_s)
            await other.abort_requests()  # not this context's abort: someone else's
            return await task

    for delay_s in (0.05, 0.02, 0.1, 0.2, 0.01):
        sample = run(one_attempt(delay_s))
        if sample.metadata.get("engine_aborts"):
            break
    print(f"engine_aborts {sample.metadata.get('engine_aborts')} after {delay_s} s, {sample.response_length} tokens")
    assert sample.metadata.get("engine_aborts") == 1, "no attempt's request was running when the abort came"
    assert sample.status is Status.TRUNCATED and sample.response_length == budget  # continued to the end
    assert len(sample.rollout_log_probs) == sample.response_length == len(sample.loss_mask)
    assert all(lp <= 0.0 for lp in sample.rollout_log_probs) and all(m == 1 for m in sample.loss_mask)
    spans = sample.weight_versions
    assert spans[0].start == 0 and spans[-1].end == budget  # both requests' tokens, in order
