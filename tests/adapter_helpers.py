"""Random LoRA adapters under PEFT's names for the tiny models, shared by the export and publish
tests."""

from __future__ import annotations

import torch

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def random_adapter(weights: dict, modules: tuple[str, ...], rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A and B for every layer's `modules` of the HF `weights`, both random (B is zero only at
    PEFT's initialisation, which would make every adapter a no-op)."""
    g = torch.Generator().manual_seed(seed)
    adapter = {}
    layers = sorted({int(n.split(".")[2]) for n in weights if n.startswith("model.layers.")})
    for i in layers:
        for module in modules:
            out, inp = weights[f"model.layers.{i}.{module}.weight"].shape
            base = f"base_model.model.model.layers.{i}.{module}"
            adapter[f"{base}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            adapter[f"{base}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.2
    return adapter


def settings_of(modules: tuple[str, ...], rank: int, alpha: float) -> dict:
    """`lora_settings(cfg)`'s dict for an adapter of `modules`."""
    return {"r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": [m.split(".")[-1] for m in modules]}
