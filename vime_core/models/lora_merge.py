"""LoRA adapters under PEFT's names, and their merge into the HF weights they adapt.

An adapter dict holds, for each adapted HF linear layer ``<module>`` (e.g.
``model.layers.0.self_attn.q_proj``), two tensors under PEFT's saved names:

    base_model.model.<module>.lora_A.weight    A  [r, in]
    base_model.model.<module>.lora_B.weight    B  [out, r]

and the merge is, in float32 and then back to W's dtype,

    W' = W + s B A,    s = lora_alpha / r

(PEFT's LoRA without rsLoRA or DoRA). The HF export's merged weights and the merged publish use
this one rule; the PEFT folder (`peft_adapter`) carries A, B and s for a reader to apply it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def lora_scale(settings: Mapping[str, Any]) -> float:
    """s = lora_alpha / r of `settings` (as `lora_settings(cfg)` gives them)."""
    rank = int(settings["r"])
    if rank <= 0:
        raise ValueError(f"LoRA settings: r={rank} must be > 0")
    return float(settings["lora_alpha"]) / rank


def adapter_pairs(adapter: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name (``<module>.weight``) -> (A, B) for every module of `adapter`; a module
    with only one of A and B, a key of another form, or shapes that do not chain raise."""
    a_of: dict[str, torch.Tensor] = {}
    b_of: dict[str, torch.Tensor] = {}
    for key, tensor in adapter.items():
        if not key.startswith(PEFT_PREFIX) or not key.endswith((LORA_A, LORA_B)):
            raise ValueError(f"adapter key {key!r} is not {PEFT_PREFIX}<module>{LORA_A} or {LORA_B}")
        module = key[len(PEFT_PREFIX) : -len(LORA_A)]
        (a_of if key.endswith(LORA_A) else b_of)[module] = tensor
    pairs = {}
    for module in sorted(a_of.keys() | b_of.keys()):
        a, b = a_of.get(module), b_of.get(module)
        if a is None or b is None:
            missing = LORA_A if a is None else LORA_B
            raise ValueError(f"adapter module {module!r} has no {missing.lstrip('.')}")
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            shapes = f"B {tuple(b.shape)} x A {tuple(a.shape)}"
            raise ValueError(f"adapter module {module!r}: {shapes} is not [out, r] x [r, in]")
        pairs[f"{module}.weight"] = (a, b)
    return pairs


def lora_delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """s B A in float32, [out, in]."""
    return scale * (b.float() @ a.float())


def merge_lora(
    named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: Mapping[str, torch.Tensor], settings: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every (name, W) of `named_tensors`, with W + s B A in W's dtype where `adapter` has
    that module (module docstring). Lazy, so a publish can stream it; an adapted module whose W
    never came, or whose W has another shape than B A, raises."""
    scale = lora_scale(settings)
    pairs = adapter_pairs(adapter)
    seen = set()
    for name, weight in named_tensors:
        pair = pairs.get(name)
        if pair is None:
            yield name, weight
            continue
        delta = lora_delta(*pair, scale)
        if delta.shape != weight.shape:
            raise ValueError(f"adapter of {name!r} gives {tuple(delta.shape)}, the weight is {tuple(weight.shape)}")
        seen.add(name)
        yield name, (weight.float() + delta.to(weight.device)).to(weight.dtype)
    if missing := sorted(pairs.keys() - seen):
        raise ValueError(f"the adapter adapts {missing[0]} (and {len(missing) - 1} more), which the weights lack")
