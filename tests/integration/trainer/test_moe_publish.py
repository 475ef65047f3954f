"""Qwen3-MoE on a real vLLM CPU server: loaded from the checkpoint it serves transformers' log-probs;
weights published from the Megatron model pass the engine's weight spec (vLLM's names: router and
per-expert projections) but are not yet served right (the xfail below: publishing even the
unchanged weights moves the served log-probs by ~0.02, issue 42)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.publish.conftest import LOGPROB_ATOL, PROMPT, make_cfg, served, started_engine
from tests.integration.trainer.test_moe import _megatron_model
from tests.moe_tiny import tiny_moe_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_engine(cache_dir, vllm_python):
    ckpt = tiny_moe_checkpoint(cache_dir)
    with started_engine(make_cfg(ckpt, vllm_python), cache_dir / "engine-logs-moe") as server:
        yield server


def _hf_logprobs(folder, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[j] | PROMPT + tokens[:j]) under transformers' model of ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)
    positions = torch.arange(len(PROMPT) - 1, len(PROMPT) - 1 + len(tokens))
    return logp[positions, torch.tensor(tokens)]


def test_engine_serves_the_checkpoint_as_transformers(moe_engine):
    """Before any publish (the module's tests run in file order on one engine)."""
    from tests.integration.publish.conftest import engine_sample

    tokens, logprobs, _ = engine_sample(moe_engine)
    expected = _hf_logprobs(Path(moe_engine.model_path), tokens)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.xfail(
    strict=True,
    reason="vLLM serves published MoE weights wrongly (even unchanged ones move log-probs ~0.02); not found yet",
)
def test_megatron_moe_weights_publish_to_vllm(single_rank, moe_engine, tmp_path):
    from vime_core.trainer.hf_convert import iter_hf_weights
    from vime_core.weight_sync.publish import publish_weights

    ckpt = Path(moe_engine.model_path)
    model, _ = _megatron_model(ckpt)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # new weights the engine has not seen: each tensor + 5% of its std as noise
        for param in model.parameters():
            param.add_(0.05 * float(param.std()) * torch.randn(param.shape, generator=gen))
    weights = {name: tensor.clone() for name, tensor in iter_hf_weights(model)}
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in weights and "model.layers.1.mlp.gate.weight" in weights

    cfg = make_cfg(moe_engine.model_path, moe_engine.cfg.vllm_python)
    stats = publish_weights(weights.items(), [moe_engine.url], 1, cfg, initial_version=0, token=moe_engine.auth_token)
    assert stats["version"] == 1
    tokens, logprobs, _, version = served(moe_engine)
    assert version == 1

    published = tmp_path / "published"  # the published weights as an HF folder for transformers
    shutil.copytree(ckpt, published)
    save_file(weights, str(published / "model.safetensors"))
    expected = _hf_logprobs(published, tokens)
    before = _hf_logprobs(ckpt, tokens)
    assert (expected - before).abs().max() > 10 * LOGPROB_ATOL  # the new weights show in the log-probs
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen3_moe"
