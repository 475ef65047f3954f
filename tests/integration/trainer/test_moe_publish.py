"""Qwen3-MoE and Mixtral on a real vLLM CPU server (one per family): loaded from the checkpoint it
serves transformers' log-probs, and weights published from the Megatron model (vLLM's names: router
and per-expert projections), first unchanged and then changed, are served as transformers serves the
same weights saved to a checkpoint; the weight check after each publish (check_weight_update_equal)
passes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.integration.publish.conftest import LOGPROB_ATOL, PROMPT, engine_call, make_cfg, served, started_engine
from tests.integration.trainer.test_moe import _megatron_model
from tests.moe_tiny import tiny_mixtral_checkpoint, tiny_moe_checkpoint

pytestmark = pytest.mark.slow


CHECKPOINTS = {"qwen3_moe": tiny_moe_checkpoint, "mixtral": tiny_mixtral_checkpoint}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def moe_engine(request, cache_dir, vllm_python):
    """A server of the family's tiny checkpoint; pytest runs each family's tests in file order on it."""
    ckpt = CHECKPOINTS[request.param](cache_dir)
    with started_engine(make_cfg(ckpt, vllm_python), cache_dir / f"engine-logs-{request.param}") as server:
        yield server


def _hf_logprobs(folder, tokens: list[int], prompt: list[int] = PROMPT) -> torch.Tensor:
    """log p(tokens[j] | prompt + tokens[:j]) under transformers' model of ``folder``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = model(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return logp[positions, torch.tensor(tokens)]


def _weight_check(engine, model, arch, previous: list[list[float]] | None) -> tuple[dict, list[list[float]]]:
    """check_weight_update_equal as the train flow runs it: the trainer's and the engine's log-probs
    of the seeded probe (vime_core/weight_sync/weight_check.py), compared."""
    from vime_core.trainer.train_step import forward_log_probs
    from vime_core.weight_sync.weight_check import compare, probe_batch, probe_tokens, prompt_logprobs_of

    tokens = probe_tokens(arch.vocab_size, seed=0, length=64)
    with torch.no_grad():
        trainer = forward_log_probs(model, probe_batch(tokens), [[0]], arch.vocab_size, 1.0, torch.device("cpu"))
    answer = engine_call(engine, "generate", tokens, {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0})
    now = [prompt_logprobs_of(answer, tokens)]
    return compare(trainer[0].tolist(), now, previous), now


def _publish_and_check(
    engine, model, arch, version: int, folder: Path, transport: str = "shm"
) -> tuple[torch.Tensor, list[int]]:
    """Publish the Megatron model's weights as ``version`` over ``transport``; the engine must serve
    what transformers serves from the same weights saved as an HF folder. Returns transformers'
    log-probs of the served sample and its tokens."""
    from vime_core.trainer.hf_convert import iter_hf_weights
    from vime_core.weight_sync.publish import publish_weights

    ckpt = Path(engine.model_path)
    weights = {name: tensor.clone() for name, tensor in iter_hf_weights(model)}
    cfg = make_cfg(engine.model_path, engine.cfg.vllm_python, weight_transport=transport)
    stats = publish_weights(
        weights.items(), [engine.url], version, cfg, initial_version=version - 1, token=engine.auth_token
    )
    assert (stats["version"], stats["transport"]) == (version, transport)
    tokens, logprobs, _, reported = served(engine)
    assert reported == version
    shutil.copytree(ckpt, folder)
    save_file(weights, str(folder / "model.safetensors"))
    expected = _hf_logprobs(folder, tokens)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    return expected, tokens


def test_engine_serves_the_checkpoint_as_transformers(moe_engine):
    """Before any publish (the module's tests run in file order on one engine)."""
    from tests.integration.publish.conftest import engine_sample

    tokens, logprobs, _ = engine_sample(moe_engine)
    expected = _hf_logprobs(Path(moe_engine.model_path), tokens)
    torch.testing.assert_close(torch.tensor(logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def _add_noise(model, seed: int) -> None:
    """Each parameter plus 5% of its std as seeded Gaussian noise."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * float(param.std()) * torch.randn(param.shape, generator=gen))


def test_megatron_moe_weights_publish_to_vllm(single_rank, moe_engine, tmp_path):
    """Version 1: the unchanged weights (the CPU experts' packed layout survives a reload); version
    2: every tensor plus 5% of its std as noise, weights the engine has not seen; version 3: more
    noise, over the disk transport (vLLM's reload from a folder)."""
    ckpt = Path(moe_engine.model_path)
    model, arch = _megatron_model(ckpt)
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == arch.model_type in CHECKPOINTS
    names = {name for name, _ in model.named_parameters()}
    assert "decoder.layers.1.mlp.experts.local_experts.7.linear_fc1.weight" in names

    _publish_and_check(moe_engine, model, arch, 1, tmp_path / "v1")
    check, probe = _weight_check(moe_engine, model, arch, None)
    assert check["max_abs_diff"] < LOGPROB_ATOL, check

    for version, transport in ((2, "shm"), (3, "disk")):
        _add_noise(model, seed=version)
        expected, tokens = _publish_and_check(moe_engine, model, arch, version, tmp_path / f"v{version}", transport)
        assert (expected - _hf_logprobs(ckpt, tokens)).abs().max() > 10 * LOGPROB_ATOL  # the new weights show
        check, probe = _weight_check(moe_engine, model, arch, probe)
        assert check["max_abs_diff"] < LOGPROB_ATOL, check
        assert check["changed_max"] > 10 * LOGPROB_ATOL, check
