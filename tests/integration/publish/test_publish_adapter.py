"""publish_adapter against a real vLLM CPU server started for adapters (lora_publish=adapter): the
adapter serves what the merged weights serve (a transformers forward of them, and the engine of the
other publish tests given them), a new version changes the output and retires the one before the
previous, and refused adapters leave the engine serving the old version.

The tests share one server and run in file order: the first adapter publish (from version 0)
is made by a module fixture, and every test starts from the version the engine holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.integration.publish.conftest import (
    LOGPROB_ATOL,
    engine_call,
    hf_logprobs,
    make_cfg,
    perturbed,
    started_engine,
)
from tests.adapter_helpers import MLP, PROJECTIONS, random_adapter, settings_of
from vime_core.engines.adapters import adapter_name, load_adapter, served_adapters
from vime_core.engines.client import EngineClient, EngineError
from vime_core.models.lora_merge import merge_lora
from vime_core.models.peft_adapter import write_adapter_files
from vime_core.weight_sync.adapter_publish import publish_adapter
from vime_core.weight_sync.weight_spec import WeightSpecError

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

RANK, ALPHA = 4, 8.0
MODULES = PROJECTIONS + MLP
PROMPTS = [[1, 5, 9, 3, 14, 7], [1] + [3 + (i * 5) % 16 for i in range(20)], [1, 16, 4, 4, 18, 12, 3]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def adapter_root():
    root = tempfile.mkdtemp(prefix="vime-test-adapters-", dir="/dev/shm")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir, vllm_python, cache_dir):
    """The tiny Qwen3 model served for adapter publishes of rank RANK."""
    cfg = make_cfg(tiny_model_dir, vllm_python)
    # the LoRA section's fields (lora_publish, lora_rank) set as a run's configuration would
    cfg = cfg.model_copy(update={"lora_publish": "adapter", "lora_rank": RANK})
    with started_engine(cfg, cache_dir / "engine-logs") as server:
        yield server


def publish(engine, adapter: dict, version: int, root: str) -> dict:
    settings = settings_of(MODULES, RANK, ALPHA)
    return publish_adapter(
        adapter, settings, [engine.url], version, engine.model_path, root=root, token=engine.auth_token
    )


def generate(engine, prompt: list[int], params: dict, model: str | None = None) -> dict:
    async def call():
        async with EngineClient(engine.url, token=engine.auth_token, model=model) as client:
            return await client.generate(prompt, params)

    return asyncio.run(call())


def adapters_of(engine) -> dict[str, str]:
    async def call():
        async with EngineClient(engine.url, token=engine.auth_token) as client:
            return await served_adapters(client)

    return asyncio.run(call())


def greedy(engine, prompt: list[int], model: str | None = None) -> tuple[list[int], list]:
    """Greedy tokens and the response's weight-version spans."""
    params = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    choice = generate(engine, prompt, params, model)["choices"][0]
    return choice["token_ids"], choice.get("weight_versions")


def sequence_logprobs(engine, tokens: list[int], model: str | None = None) -> torch.Tensor:
    """log p(tokens[j] | tokens[:j]), j >= 1, as the engine scores the sequence as a prompt."""
    params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
    entries = generate(engine, tokens, params, model)["prompt_logprobs"]
    values = []
    for j in range(1, len(tokens)):
        value = entries[j][str(tokens[j])]
        values.append(value["logprob"] if isinstance(value, dict) else value)
    return torch.tensor(values)


def hf_greedy(model_dir, weights: dict, prompt: list[int]) -> list[int]:
    """Greedy continuation of `prompt` by a transformers model holding `weights`."""
    config = AutoConfig.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    model.tie_weights()
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


def served_as(engine, adapter: dict, base_weights: dict, model_dir, version: int) -> dict:
    """Check that the engine's `adapter_name(version)` serves the merged weights (greedy tokens,
    sequence log-probs against a transformers forward) and reports `version`; the greedy tokens."""
    merged = dict(merge_lora(base_weights.items(), adapter, settings_of(MODULES, RANK, ALPHA)))
    out = {}
    for prompt in PROMPTS:
        tokens, spans = greedy(engine, prompt, adapter_name(version))
        assert tokens == hf_greedy(model_dir, merged, prompt)
        assert [(int(s["version"]), s["start"], s["end"]) for s in spans] == [(version, 0, NEW_TOKENS)]
        scored = sequence_logprobs(engine, prompt + tokens, adapter_name(version))
        expected = hf_logprobs(model_dir, merged, prompt[:1], prompt[1:] + tokens)
        assert torch.allclose(scored, expected, atol=LOGPROB_ATOL), (scored - expected).abs().max()
        out[tuple(prompt)] = tokens
    assert engine_call(engine, "weight_version") == version
    return out


@pytest.fixture(scope="module")
def first(lora_engine, base_weights, adapter_root) -> dict:
    adapter = random_adapter(base_weights, MODULES, RANK, seed=11)
    base = {tuple(p): greedy(lora_engine, p)[0] for p in PROMPTS}
    stats = publish(lora_engine, adapter, 1, adapter_root)
    return {"adapter": adapter, "stats": stats, "base": base}


def test_adapter_v1_serves_the_merged_weights(first, lora_engine, base_weights, tiny_model_dir):
    """The adapter publish's stats, and the engine serving what the merged weights give in transformers.
    (Not compared on the session's publish engine: publishing there would change the engine the
    other publish tests expect at its first version.)"""
    adapter, stats = first["adapter"], first["stats"]
    assert stats["version"] == 1 and stats["adapter"] == adapter_name(1) and stats["transport"] == "adapter"
    assert stats["bytes"] == sum(t.numel() * 4 for t in adapter.values())
    assert set(stats["seconds"]) >= {"validate", "write", "pause", "load", "version", "resume", "verify", "total"}
    tokens = served_as(lora_engine, adapter, base_weights, tiny_model_dir, 1)
    assert tokens != first["base"]  # the adapter changes what is generated
    assert {p: greedy(lora_engine, list(p))[0] for p in first["base"]} == first["base"]  # the base model is intact
    full_bytes = sum(t.numel() * t.element_size() for t in base_weights.values())
    logger.info("adapter publish %s; the full weights a merged publish sends: %d bytes", stats, full_bytes)
    assert stats["bytes"] < full_bytes


def test_new_versions_change_the_output_and_retire_old_adapters(
    first, lora_engine, base_weights, tiny_model_dir, adapter_root
):
    v = engine_call(lora_engine, "weight_version")
    before = {tuple(p): greedy(lora_engine, p, adapter_name(v))[0] for p in PROMPTS}
    second = random_adapter(base_weights, MODULES, RANK, seed=12)
    stats = publish(lora_engine, second, v + 1, adapter_root)
    assert stats["retired"] == [adapter_name(k) for k in range(1, v)]
    after = served_as(lora_engine, second, base_weights, tiny_model_dir, v + 1)
    assert after != before
    served = adapters_of(lora_engine)
    assert sorted(served) == sorted([adapter_name(v), adapter_name(v + 1)])  # the previous one stays
    folders = sorted(os.listdir(adapter_root))
    publish(lora_engine, second, v + 1, adapter_root)  # repeated (an engine caught up): nothing changes
    assert sorted(os.listdir(adapter_root)) == folders
    assert adapters_of(lora_engine) == served
    assert {tuple(p): greedy(lora_engine, p, adapter_name(v + 1))[0] for p in PROMPTS} == after
    assert engine_call(lora_engine, "weight_version") == v + 1

    stats = publish(lora_engine, random_adapter(base_weights, MODULES, RANK, seed=13), v + 2, adapter_root)
    assert stats["retired"] == [adapter_name(v)]
    assert not os.path.exists(served[adapter_name(v)])  # its folder is gone with it
    with pytest.raises(EngineError) as err:
        greedy(lora_engine, PROMPTS[0], adapter_name(v))
    assert err.value.status == 404
    served = adapters_of(lora_engine)
    assert sorted(os.listdir(adapter_root)) == sorted(os.path.basename(f) for f in served.values())


def _still_serving(engine, version: int, tokens: dict, root: str, folders: list[str]) -> None:
    assert engine_call(engine, "weight_version") == version
    assert not engine_call(engine, "is_paused")
    assert {tuple(p): greedy(engine, p, adapter_name(version))[0] for p in PROMPTS} == tokens
    assert sorted(os.listdir(root)) == folders  # the refused adapter's folder is not left behind


def test_refused_adapters_leave_the_engine_serving(lora_engine, base_weights, adapter_root):
    v = engine_call(lora_engine, "weight_version")
    tokens = {tuple(p): greedy(lora_engine, p, adapter_name(v))[0] for p in PROMPTS}
    folders = sorted(os.listdir(adapter_root))
    adapter = random_adapter(base_weights, MODULES, RANK, seed=14)

    # the run-time adapter routes answer only with the run's token, as every other route
    folder = tempfile.mkdtemp(prefix="unauthenticated-", dir=adapter_root)
    write_adapter_files(adapter, settings_of(MODULES, RANK, ALPHA), lora_engine.model_path, folder)
    with pytest.raises(EngineError) as err:
        asyncio.run(load_adapter(EngineClient(lora_engine.url), adapter_name(v + 1), folder))  # no session kept
    assert err.value.status == 401
    shutil.rmtree(folder)
    _still_serving(lora_engine, v, tokens, adapter_root, folders)

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    wrong_shape = {**adapter, key: adapter[key][:, :-1]}
    with pytest.raises(WeightSpecError, match="layers.0.self_attn.q_proj.weight' is"):
        publish(lora_engine, wrong_shape, v + 1, adapter_root)
    _still_serving(lora_engine, v, tokens, adapter_root, folders)

    # rank 16 > the engine's --max-lora-rank 8: vLLM refuses it when loading, after the pause
    too_wide = random_adapter(base_weights, MODULES, 16, seed=15)
    with pytest.raises(EngineError, match="load_lora_adapter"):
        publish_adapter(
            too_wide,
            settings_of(MODULES, 16, ALPHA),
            [lora_engine.url],
            v + 1,
            lora_engine.model_path,
            root=adapter_root,
            token=lora_engine.auth_token,
        )
    _still_serving(lora_engine, v, tokens, adapter_root, folders)


def test_base_weights_published_again_keep_the_adapter(lora_engine, base_weights, tiny_model_dir, adapter_root):
    """What an engine woken from a level-2 sleep needs in adapter mode: its base weights sent again
    through the usual transport, at the same version. vLLM then drops its adapters from the
    device and loads them again from their folders when asked: the adapter applies to the new
    base (shown with changed base weights, then the checkpoint's again)."""
    from vime_core.weight_sync.publish import publish_weights

    v = engine_call(lora_engine, "weight_version") + 1
    adapter = random_adapter(base_weights, MODULES, RANK, seed=16)
    publish(lora_engine, adapter, v, adapter_root)
    cfg = make_cfg(lora_engine.model_path, lora_engine.cfg.vllm_python)
    for base in (perturbed(base_weights, seed=17), base_weights):
        publish_weights(base.items(), [lora_engine.url], v, cfg, token=lora_engine.auth_token)
        served_as(lora_engine, adapter, base, tiny_model_dir, v)
