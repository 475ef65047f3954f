"""The PEFT adapter folder against the real `peft` package: PeftModel.from_pretrained on the tiny
HF model gives the logits of the same model with W + (alpha / r) B A merged by `merge_lora`;
and the merge's and the folder's refusals."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.adapter_helpers import MLP, PROJECTIONS, random_adapter, settings_of
from vime_core.models.lora_merge import merge_lora
from vime_core.models.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, write_adapter_files
from vime_core.trainer.peft_export import write_peft_folder

IDS = torch.tensor([[1, 5, 9, 3, 14, 7, 2, 11, 4, 6, 8, 12]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.fixture(scope="module")
def base_weights(tiny_model_dir) -> dict:
    return load_file(str(tiny_model_dir / "model.safetensors"))


def merged_model(model_dir, weights: dict):
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model


@pytest.mark.parametrize(("modules", "rank", "alpha"), [(PROJECTIONS + MLP, 4, 8.0), (("self_attn.q_proj",), 2, 3.0)])
def test_peft_folder_gives_the_merged_logits(tiny_model_dir, base_weights, tmp_path, modules, rank, alpha):
    adapter = random_adapter(base_weights, modules, rank, seed=rank)
    settings = settings_of(modules, rank, alpha)
    folder = write_peft_folder(adapter, settings, str(tiny_model_dir), tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE])

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    base_logits = logits(base)
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    assert peft_model.peft_config["default"].r == rank
    merged = merged_model(tiny_model_dir, dict(merge_lora(base_weights.items(), adapter, settings)))

    with_adapter, with_merge = logits(peft_model), logits(merged)
    moved = (with_adapter - base_logits).abs().max()
    assert moved > 100 * (with_adapter - with_merge).abs().max()  # the adapter changes the output
    torch.testing.assert_close(with_adapter, with_merge, atol=1e-4, rtol=1e-4)


def test_bf16_folder_matches_the_bf16_merge(tiny_model_dir, base_weights, tmp_path):
    modules = PROJECTIONS + MLP
    adapter = random_adapter(base_weights, modules, 8, seed=3)
    settings = settings_of(modules, 8, 16.0)
    folder = write_peft_folder(adapter, settings, str(tiny_model_dir), tmp_path / "a", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in load_file(f"{folder}/{WEIGHTS_FILE}").values())

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval()
    peft_model = PeftModel.from_pretrained(base, folder).eval()
    bf16 = {k: v.to(torch.bfloat16) for k, v in base_weights.items()}
    bf16_adapter = {k: v.to(torch.bfloat16) for k, v in adapter.items()}
    merged = merged_model(tiny_model_dir, dict(merge_lora(bf16.items(), bf16_adapter, settings))).to(torch.bfloat16)
    with_adapter, with_merge = logits(peft_model), logits(merged)
    base_logits = logits(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval())
    # bf16: the adapter's path rounds x A and its product, the merge rounds W + s B A once
    spread = (with_adapter - with_merge).abs().max()
    assert spread < 0.1 * (with_adapter - base_logits).abs().max()


def test_config_names_plain_lora(tiny_model_dir, base_weights, tmp_path):
    modules = ("self_attn.v_proj", "mlp.down_proj")
    adapter = random_adapter(base_weights, modules, 2, seed=0)
    write_adapter_files(adapter, settings_of(modules, 2, 4.0), "s3://user:pw@host/model", tmp_path)
    config = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert config["target_modules"] == ["down_proj", "v_proj"] and config["r"] == 2 and config["lora_alpha"] == 4.0
    assert config["peft_type"] == "LORA" and not config["use_rslora"] and config["bias"] == "none"
    assert "pw" not in config["base_model_name_or_path"]  # no credential in the file


def test_refusals(base_weights, tmp_path):
    modules = ("self_attn.q_proj",)
    adapter = random_adapter(base_weights, modules, 2, seed=0)
    with pytest.raises(ValueError, match="rank 2, settings say r=4"):
        write_adapter_files(adapter, settings_of(modules, 4, 4.0), "m", tmp_path)
    with pytest.raises(ValueError, match="target_modules are k_proj"):
        write_adapter_files(adapter, {**settings_of(modules, 2, 4.0), "target_modules": ["k_proj"]}, "m", tmp_path)
    half = {k: v for k, v in adapter.items() if "layers.0" not in k or "lora_A" in k}
    with pytest.raises(ValueError, match="layers.0.self_attn.q_proj' has no lora_B"):
        dict(merge_lora(base_weights.items(), half, settings_of(modules, 2, 4.0)))
    lacking = {k: v for k, v in base_weights.items() if k != "model.layers.1.self_attn.q_proj.weight"}
    with pytest.raises(ValueError, match="adapts model.layers.1.self_attn.q_proj.weight"):
        dict(merge_lora(lacking.items(), adapter, settings_of(modules, 2, 4.0)))
    assert not list(tmp_path.iterdir())  # nothing written by a refused export
