"""LoRA adapters on Megatron's tensor-parallel linear layers.

Each adapted layer (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) keeps its base
weight W, frozen, and gains ``y = W x + s B A dropout(x)``, ``s = lora_alpha / lora_rank``, with A
[r, in] Kaiming-uniform (as PEFT) and B [out, r] zero at the start. The adapter is split the way the
base layer is split over the TP ranks:

    column-parallel W (rows split):  A replicated, B split by rows like W;
        u = A x, all-reduced in backward (its gradient sums every rank's B_r^T dy_r)
    row-parallel W (columns split):  A split by columns like W, B replicated;
        u = sum_r A_r x_r, all-reduced in forward (r values per token, not the output's width)

so every gradient is exact without a TP reduction of the adapters' gradients. The adapter's
parameters are named ``<layer>.lora.A`` / ``<layer>.lora.B``; the base names stay, so loading and
the HF conversion read W as before, and only the adapters require gradients (Megatron's DDP and
optimizer leave frozen parameters out of their buffers and state).

Interface for the publish and export side (full, TP-gathered tensors; collectives over TP):

    lora_hf_state(model, arch, prefix="base_model.model.") -> dict[str, torch.Tensor]
        PEFT names: ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` [r, in]
        and ``.lora_B.weight`` [out, r] for q/k/v/o_proj and mlp.gate/up/down_proj; a fused
        layer's A is shared by its projections, its B split as hf_convert splits W.
    lora_settings(cfg) -> dict   r, lora_alpha, lora_dropout, target_modules (HF names)
    merged_weight(module) -> torch.Tensor   this rank's W + s B A of an adapted layer (or W)
    adapters_disabled(model)                context: the base model (the KL reference)
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from vime_core.config.lora import MEGATRON_LAYERS, megatron_targets, target_names
from vime_core.trainer.hf_convert import Rule, shard_for_rank, shards_to_hf, unwrap
from vime_core.trainer.model import HFArchitecture

# How each adapted layer's A and B are split over TP, as hf_convert's rule kinds.
SPLITS: dict[str, tuple[str, str]] = {
    "self_attention.linear_qkv": ("replicated", "qkv"),
    "self_attention.linear_proj": ("row", "replicated"),
    "mlp.linear_fc1": ("replicated", "gate_up"),
    "mlp.linear_fc2": ("row", "replicated"),
}
ROW_PARALLEL = ("self_attention.linear_proj", "mlp.linear_fc2")


class LoRAAdapter(torch.nn.Module):
    """``s B A dropout(x)`` for one TP rank; ``row`` says the base layer is row-parallel."""

    def __init__(
        self, in_local: int, out_local: int, rank: int, alpha: float, dropout: float, row: bool, dtype, device
    ) -> None:
        super().__init__()
        self.A = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.scale = alpha / rank
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()
        self.row = row
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.A.dtype)
        if torch.is_grad_enabled():  # the training forward only: log-prob passes (no_grad) are deterministic
            x = self.dropout(x)
        u = torch.nn.functional.linear(x, self.A)
        u = reduce_from_tensor_model_parallel_region(u) if self.row else copy_to_tensor_model_parallel_region(u)
        return torch.nn.functional.linear(u, self.B) * self.scale

    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + s B A (W's shard, dtype and device), summed in fp32."""
        delta = (self.B.detach().float() @ self.A.detach().float()) * self.scale
        return (weight.detach().float() + delta).to(weight.dtype)


def _add_adapter(module: Any, args: tuple, output: Any) -> Any:
    """Forward hook of an adapted layer: Megatron's linears return (output, bias)."""
    adapter = module.lora
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]).to(out.dtype), bias


def _input_requires_grad(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the frozen embedding: its output requires a gradient, so that a layer
    recomputed by Megatron's full recompute (a reentrant autograd Function, which gives its output
    a gradient only when an input has one) passes the adapters' gradients on. The embedding's
    weight stays frozen; the cost is the gradient of the first layer's input."""
    return output.requires_grad_(True) if torch.is_grad_enabled() and not output.requires_grad else output


def adapted_layers(model: Any) -> Iterator[tuple[int, str, Any]]:
    """(layer index, Megatron layer name, module) of every adapted linear layer."""
    for i, layer in enumerate(unwrap(model).decoder.layers):
        for name in SPLITS:
            module = layer.get_submodule(name)
            if hasattr(module, "lora"):
                yield i, name, module


def _full_a(seed: int, layer: int, name: str, rank: int, fan_in: int) -> torch.Tensor:
    """The whole A of one layer, Kaiming-uniform (bound 1/sqrt(fan_in), PEFT's a=sqrt(5)), from a
    generator seeded by (seed, layer, name): the same tensor at every TP size."""
    digest = hashlib.sha256(f"{seed}:{layer}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return (torch.rand(rank, fan_in, generator=gen, dtype=torch.float64) * 2 - 1).float() / math.sqrt(fan_in)


def apply_lora(model: Any, cfg: Any, arch: HFArchitecture, tp: int, tp_rank: int) -> int:
    """Freeze every parameter of ``model`` and add adapters on ``cfg.target_modules``; returns the
    number of adapter parameters on this rank. Call after the base weights are loaded and before
    Megatron's DDP wraps the model."""
    if arch.num_experts:
        raise ValueError(
            f"lora_rank={cfg.lora_rank} on model_type={arch.model_type!r}: LoRA on mixture-of-experts layers is not "
            "supported yet; train the full weights (lora_rank 0)"
        )
    bare = unwrap(model)
    for param in bare.parameters():
        param.requires_grad_(False)
    if getattr(bare, "embedding", None) is not None:  # the first pipeline stage's
        bare.embedding.register_forward_hook(_input_requires_grad)
    rank = cfg.lora_rank
    count = 0
    for i, layer in enumerate(bare.decoder.layers):
        for name in megatron_targets(cfg.target_modules):
            module = layer.get_submodule(name)
            weight = module.weight
            out_local, in_local = weight.shape
            row = name in ROW_PARALLEL
            adapter = LoRAAdapter(
                in_local, out_local, rank, cfg.lora_alpha, cfg.lora_dropout, row, weight.dtype, weight.device
            )
            module.lora = adapter
            module.register_forward_hook(_add_adapter)
            fan_in = in_local * (tp if row else 1)
            full_a = _full_a(cfg.seed, i, name, rank, fan_in)
            load_full_adapter(module, name, arch, tp, tp_rank, full_a, None)
            _mark_tp(adapter, row)
            count += adapter.A.numel() + adapter.B.numel()
    return count


def _mark_tp(adapter: LoRAAdapter, row: bool) -> None:
    """Tag the split parameter as Megatron's initialisers do (the grad norm counts replicated
    parameters once)."""
    if row:
        set_tensor_model_parallel_attributes(adapter.A, True, 1, 1)
    else:
        set_tensor_model_parallel_attributes(adapter.B, True, 0, 1)


def load_full_adapter(
    module: Any, name: str, arch: HFArchitecture, tp: int, tp_rank: int, full_a: Any, full_b: Any
) -> None:
    """Copy this rank's part of whole adapter tensors into ``module.lora``. ``full_a`` / ``full_b``:
    one tensor, or a list with one per HF projection of the layer (MEGATRON_LAYERS order; a fused
    layer's A must be the same for all); None leaves it as it is."""
    kind_a, kind_b = SPLITS[name]
    hf = MEGATRON_LAYERS[name]
    with torch.no_grad():
        for param, kind, full in ((module.lora.A, kind_a, full_a), (module.lora.B, kind_b, full_b)):
            if full is None:
                continue
            parts = list(full) if isinstance(full, (list, tuple)) else [full] * len(hf)
            if kind == "replicated":
                parts = parts[:1]
            value = shard_for_rank(Rule(name, hf[: len(parts)], kind), parts, arch, tp, tp_rank)
            param.copy_(value.to(dtype=param.dtype, device=param.device))


def merged_weight(module: Any) -> torch.Tensor:
    """This rank's W + s B A of an adapted layer in W's dtype (W itself when not adapted)."""
    adapter = getattr(module, "lora", None)
    return module.weight.detach() if adapter is None else adapter.merged(module.weight)


@contextlib.contextmanager
def adapters_disabled(model: Any):
    """Forward the base model: every adapter off inside the block (the KL reference)."""
    adapters = [module.lora for _, _, module in adapted_layers(model)]
    states = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, state in zip(adapters, states):
            a.enabled = state


def lora_hf_state(model: Any, arch: HFArchitecture, prefix: str = "base_model.model.") -> dict[str, torch.Tensor]:
    """Whole adapter tensors under PEFT names (see the module docstring). A collective over the
    TP group: every rank calls it; every rank gets the whole tensors."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None

    def gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        if tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts

    state: dict[str, torch.Tensor] = {}
    for i, name, module in adapted_layers(model):
        kind_a, kind_b = SPLITS[name]
        hf = MEGATRON_LAYERS[name]
        a_parts = shards_to_hf(Rule(name, hf, kind_a), gather, module.lora.A.detach(), arch, tp)
        b_parts = shards_to_hf(Rule(name, hf, kind_b), gather, module.lora.B.detach(), arch, tp)
        for j, proj in enumerate(hf):
            base = f"{prefix}model.layers.{i}.{proj}"
            state[f"{base}.lora_A.weight"] = a_parts[min(j, len(a_parts) - 1)].clone()
            state[f"{base}.lora_B.weight"] = b_parts[min(j, len(b_parts) - 1)].clone()
    return state


ADAPTER_KEYS = (".lora.A", ".lora.B")
FINGERPRINT_CHUNK = 1 << 25  # elements


def frozen_names(model: Any) -> set[str]:
    """The state-dict names of the model's frozen (base) parameters (the wrappers' state dicts are
    the bare model's, without their `module.` prefix)."""
    return {n for n, p in unwrap(model).named_parameters() if not p.requires_grad}


def base_fingerprint(model: Any) -> list[float]:
    """This rank's frozen base as two float64 numbers, [sum of w, sum of w^2] over every frozen
    parameter: what a checkpoint that leaves the base out compares at load, so that adapters are
    never put on another base than the one they were trained on. Exact for bf16 and fp32 weights
    up to the float64 sum's order (checked with a relative tolerance of 1e-9)."""
    sums: list[torch.Tensor] = []
    for _, p in sorted((n, p) for n, p in unwrap(model).named_parameters() if not p.requires_grad):
        for chunk in p.detach().reshape(-1).split(FINGERPRINT_CHUNK):  # float64 copies of 256 MiB at most
            w = chunk.double()
            sums.append(torch.stack([w.sum(), w.square().sum()]))
    return torch.stack(sums).sum(0).tolist() if sums else [0.0, 0.0]


def checkpoint_model_state(model: Any, lora: bool) -> tuple[dict[str, Any], list[float] | None]:
    """What a checkpoint keeps of the model and the base's fingerprint. With LoRA: every entry
    but the frozen base (the run's hf_checkpoint, which `init` loads again; at 14B the base is
    29.5 GB, the adapters of rank 64 about 0.5 GB), and `base_fingerprint`. Without: every entry, None."""
    state = model.state_dict()
    if not lora:  # (the run's lora_rank: adapted_layers reads dense layers, not an MoE model's)
        return state, None
    frozen = frozen_names(model)
    return {k: v for k, v in state.items() if k not in frozen}, base_fingerprint(model)


def load_model_state(model: Any, saved: dict[str, Any], fingerprint: list[float] | None, where: str) -> None:
    """Load what `checkpoint_model_state` kept: the whole model (no fingerprint: a full model, or a
    LoRA checkpoint of an earlier vime that held its base), or the adapters onto the base loaded at
    init, which must be the one they were trained on (one line naming the checkpoint if not)."""
    if fingerprint is None:
        model.load_state_dict(saved, strict=True)
        return
    mine = base_fingerprint(model)
    if not all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9) for a, b in zip(mine, fingerprint)):
        raise ValueError(
            f"{where} holds adapters trained on another base model than this run's hf_checkpoint (base weights' "
            f"sum and sum of squares {fingerprint[0]:.6g}, {fingerprint[1]:.6g} against {mine[0]:.6g}, {mine[1]:.6g}): "
            "resume with the hf_checkpoint the run started from"
        )
    own = model.state_dict().keys()  # (Megatron's DDP wrapper returns no key lists from load_state_dict)
    missing, unexpected = sorted(own - saved.keys() - frozen_names(model)), sorted(saved.keys() - own)
    if missing or unexpected:
        raise ValueError(
            f"{where}: the adapters' checkpoint does not match this model (missing {missing}, unexpected {unexpected})"
        )
    model.load_state_dict(saved, strict=False)


def check_lora_state(saved: dict[str, Any], own: dict[str, Any], lora_rank: int, where: str) -> None:
    """Refuse, in one line, a checkpoint whose adapters are not this run's (another lora_rank,
    or saved with LoRA on or off the other way)."""
    adapters = {k: tuple(v.shape) for k, v in saved.items() if k.endswith(ADAPTER_KEYS)}
    mine = {k: tuple(v.shape) for k, v in own.items() if k.endswith(ADAPTER_KEYS)}
    if adapters != mine:
        ranks = sorted({shape[0] for k, shape in adapters.items() if k.endswith(".lora.A")})
        held = f"adapters of rank {', '.join(map(str, ranks))}" if ranks else "no LoRA adapters"
        raise ValueError(
            f"{where} holds {held} on {len(adapters) // 2} layers; this run has lora_rank={lora_rank} on "
            f"{len(mine) // 2} (target_modules): resume with the settings it was saved with"
        )


def lora_settings(cfg: Any) -> dict[str, Any]:
    """The adapter's settings as PEFT's LoraConfig names them."""
    return {
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": target_names(cfg.target_modules),
    }
