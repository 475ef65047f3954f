"""One real vLLM CPU server (fp32, `vime_shm` backend, vime worker extension) shared by every
publish test, plus helpers that compare its log-probs with a transformers forward."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

# A prompt longer than one KV block, so its prefix is cached and a missed flush would show.
PROMPT = [1] + [3 + (i * 7) % 16 for i in range(47)]
NEW_TOKENS = 6
# fp32 engine vs fp32 transformers on the same weights: kernels differ in summation order only.
LOGPROB_ATOL = 1e-4


def make_cfg(model_dir: Path, vllm_python: str, **overrides):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values

    values = {
        "hf_checkpoint": str(model_dir),
        "vllm_python": vllm_python,
        "device": "cpu",
        "bf16": False,
        "rollout_max_context_len": 128,
        "update_weight_buffer_size": 64 * 1024,
    }
    values.update(overrides)
    return make_config(demo_values(values))


@contextmanager
def started_engine(cfg, log_dir: Path):
    """A started EngineServer for `cfg`; shut down on leaving (also when it failed to start)."""
    from vime_core.engines.server import EngineServer

    server = EngineServer(cfg, 0, log_dir=str(log_dir))
    try:
        server.start()
        yield server
    finally:
        server.shutdown()


@pytest.fixture(scope="session")
def publish_engine(tiny_model_dir, vllm_python, cache_dir):
    """The tiny Qwen3 model on the `vime_shm` backend; shut down at the end of the session."""
    with started_engine(make_cfg(tiny_model_dir, vllm_python), cache_dir / "engine-logs") as server:
        yield server


def engine_call(engine, method: str, *args, **kwargs):
    """`EngineClient.<method>` on a started EngineServer, with its token."""
    from vime_core.engines.client import EngineClient

    async def call():
        async with EngineClient(engine.url, token=engine.auth_token) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(call())


def engine_sample(
    engine, prompt: list[int] = PROMPT, n: int = NEW_TOKENS, seed: int | None = None
) -> tuple[list[int], list[float], list]:
    """Sampled tokens (temperature 1, so processed log-probs are the plain ones), their log-probs
    and the response's weight-version spans."""
    params = {"max_tokens": n, "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
    if seed is not None:
        params["seed"] = seed
    answer = engine_call(engine, "generate", prompt, params)
    choice = answer["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]], choice.get("weight_versions")


def hf_logprobs(model_dir: Path, state_dict: dict, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(tokens[j] | prompt + tokens[:j]) under a transformers model holding `state_dict`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    if config.tie_word_embeddings:
        model.tie_weights()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[positions, torch.tensor(tokens)]


def served(engine) -> tuple:
    """What the engine serves now: a sample of PROMPT (tokens, log-probs, weight-version spans)
    and the version it reports."""
    return (*engine_sample(engine), engine_call(engine, "weight_version"))


def check_served(observed: tuple, model_dir, weights: dict, version: int) -> None:
    """`observed` (from served()) has the log-probs of a transformers forward of `weights`, and
    the engine reported `version`."""
    tokens, logprobs, spans, reported = observed
    expected = hf_logprobs(model_dir, weights, PROMPT, tokens)
    assert torch.allclose(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL), (logprobs, expected.tolist())
    assert reported == version
    from vime_core.engines.client import parse_weight_version

    assert [(parse_weight_version(s["version"]), s["start"], s["end"]) for s in spans] == [(version, 0, len(tokens))]


def assert_serves(engine, model_dir, weights: dict, version: int) -> None:
    """The engine's log-probs equal a transformers forward of `weights`, and it reports `version`."""
    check_served(served(engine), model_dir, weights, version)


def perturbed(state_dict: dict, seed: int, scale: float = 0.05) -> dict:
    """The weights plus seeded Gaussian noise (scale x each tensor's std, at least `scale`)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in state_dict.items():
        std = float(t.float().std()) if t.numel() > 1 else 1.0
        out[name] = t + scale * max(std, 1e-2) * torch.randn(t.shape, generator=g, dtype=t.dtype)
    return out


@pytest.fixture(scope="session")
def base_weights(tiny_model_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(str(tiny_model_dir / "model.safetensors"))
