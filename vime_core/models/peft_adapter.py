"""A LoRA adapter as a PEFT adapter folder, which `peft.PeftModel.from_pretrained(base, path)` and
vLLM's LoRA loader read:

    adapter_config.json          LoraConfig's fields: peft_type LORA, task_type CAUSAL_LM, r,
                                 lora_alpha, lora_dropout, target_modules (HF short names),
                                 base_model_name_or_path; plain LoRA (no bias, rsLoRA, DoRA or
                                 modules_to_save)
    adapter_model.safetensors    the adapter's tensors under PEFT's saved names
                                 (`lora_merge`: base_model.model.<module>.lora_A.weight ...)

A reader applies W + (lora_alpha / r) B A, the rule of `lora_merge.merge_lora`. The trainer's
export publishes such a folder to storage (`vime_core/trainer/peft_export.py`); the adapter
publish writes one for the engines (`vime_core/weight_sync/adapter_publish.py`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vime_core.models.lora_merge import adapter_pairs, lora_scale
from vime_core.utils.secrets import redact_text

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_config(adapter: Mapping[str, torch.Tensor], settings: Mapping[str, Any], base_model: str) -> dict:
    """adapter_config.json's contents; the adapter's modules and rank must agree with `settings`."""
    lora_scale(settings)  # r > 0
    pairs = adapter_pairs(adapter)
    if not pairs:
        raise ValueError("the adapter has no tensors")
    rank = int(settings["r"])
    if wrong := [name for name, (a, _) in pairs.items() if a.shape[0] != rank]:
        raise ValueError(f"adapter of {wrong[0]} has rank {pairs[wrong[0]][0].shape[0]}, settings say r={rank}")
    found = sorted({name.rsplit(".", 2)[-2] for name in pairs})
    named = sorted(settings.get("target_modules") or found)
    if found != named:
        raise ValueError(f"the adapter adapts {','.join(found)}, settings' target_modules are {','.join(named)}")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": redact_text(str(base_model)),
        "r": rank,
        "lora_alpha": float(settings["lora_alpha"]),
        "lora_dropout": float(settings.get("lora_dropout", 0.0)),
        "target_modules": found,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def write_adapter_files(
    adapter: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    base_model: str,
    folder: str | Path,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the two files into the existing local `folder` (tensors in `dtype`, default their
    own); returns the folder."""
    folder = Path(folder)
    config = adapter_config(adapter, settings, base_model)
    tensors = {k: t.detach().to("cpu", dtype or t.dtype).contiguous() for k, t in adapter.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return folder
