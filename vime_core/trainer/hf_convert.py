"""Hugging Face <-> Megatron weight conversion, sharded for tensor parallelism.

One table (``_layer_rules`` / ``_model_rules``) says, for every Megatron parameter of the local
layer spec, which HF tensors it is made of and how it is split over TP ranks; both directions
read it.

Layouts (``tp`` ranks, ``g`` KV groups, ``n`` query heads, ``d`` head dim):

* **fused QKV** (``linear_qkv``): per KV group, the group's ``n/g`` query heads, then its key head,
  then its value head: ``[q_0 .. q_{n/g-1}, k, v]`` repeated ``g`` times along dim 0 (rows of
  ``d``). Groups are contiguous, so rank ``r`` holds groups ``[r*g/tp, (r+1)*g/tp)`` = the
  ``r``-th of ``tp`` equal dim-0 chunks. Biases (Qwen2) follow the same layout.
* **gate/up** (``linear_fc1``): rank ``r`` holds ``[gate_r; up_r]`` where ``gate_r``/``up_r`` are
  the ``r``-th dim-0 chunks of ``gate_proj``/``up_proj`` (SwiGLU splits each rank's output in two).
* **row-parallel** (``linear_proj`` = ``o_proj``, ``linear_fc2`` = ``down_proj``): dim-1 chunks.
* **vocab-parallel** (``word_embeddings`` = ``embed_tokens``, ``output_layer`` = ``lm_head``):
  the vocabulary padded with zero rows to a multiple of ``tp`` (``model.padded_vocab_size``),
  then dim-0 chunks; the padding is cut on the way back.
* norms (and Qwen3's per-head q/k norms) are replicated.

``iter_hf_weights`` is a collective over the TP group (``all_gather``): every TP rank of the
group must iterate it in step, even if only one of them uses the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from vime_core.trainer.model import HFArchitecture, padded_vocab_size

# HF tensors that checkpoints sometimes carry but that are not weights.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointMismatchError(ValueError):
    """The HF tensors do not match the model: missing, extra or wrongly shaped tensors."""


@dataclass(frozen=True)
class Rule:
    """How one Megatron parameter is built from HF tensors and split over TP ranks."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # replicated | vocab | row | qkv | gate_up


def _layer_rules(arch: HFArchitecture, i: int) -> list[Rule]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = h + "self_attn."
    rules = [
        Rule(m + "self_attention.linear_qkv.weight", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"), "qkv"),
    ]
    if arch.qkv_bias:
        rules.append(Rule(m + "self_attention.linear_qkv.bias", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"), "qkv"))
    if arch.qk_norm:
        rules.append(Rule(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
        rules.append(Rule(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
    rules += [
        Rule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"),
        Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
        Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
        Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"),
        Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
    ]
    return rules


def conversion_rules(arch: HFArchitecture) -> list[Rule]:
    """All rules in HF checkpoint order (embeddings, layers, final norm, LM head)."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(arch.num_layers):
        rules += _layer_rules(arch, i)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not arch.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


# ---- fused QKV layout ------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture) -> torch.Tensor:
    """[q; k; v] (HF, head-major) -> Megatron's per-KV-group layout [q_g.., k_g, v_g] x groups."""
    g, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // g
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


def split_qkv(fused: torch.Tensor, arch: HFArchitecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv`` (on the full, TP-gathered tensor)."""
    g, d = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_heads // g
    rest = fused.shape[1:]
    grouped = fused.reshape(g, (per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [per_group * d, d, d], dim=1)
    return (
        q.reshape(-1, *rest).contiguous(),
        k.reshape(-1, *rest).contiguous(),
        v.reshape(-1, *rest).contiguous(),
    )


# ---- HF -> Megatron shard ----------------------------------------------------------------------


def pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    extra = padded - weight.shape[0]
    if extra == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(extra, *weight.shape[1:])], dim=0)


def shard_for_rank(rule: Rule, hf: list[torch.Tensor], arch: HFArchitecture, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of the Megatron parameter ``rule.megatron``."""
    if rule.kind == "replicated":
        return hf[0]
    if rule.kind == "vocab":
        return pad_vocab(hf[0], padded_vocab_size(arch.vocab_size, tp)).chunk(tp, dim=0)[rank]
    if rule.kind == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    if rule.kind == "qkv":
        return fuse_qkv(*hf, arch).chunk(tp, dim=0)[rank]
    if rule.kind == "gate_up":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    raise AssertionError(rule.kind)


def hf_to_megatron_shard(
    hf_tensors: Mapping[str, torch.Tensor], arch: HFArchitecture, tp: int, rank: int, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Megatron-named tensors for TP rank ``rank``; raises ``CheckpointMismatchError`` naming every
    missing and unexpected HF tensor of ``source``."""
    rules = conversion_rules(arch)
    wanted = {name for rule in rules for name in rule.hf}
    allowed_extra = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    present = {n for n in hf_tensors if not n.endswith(IGNORED_HF_SUFFIXES)}
    missing = sorted(wanted - present)
    extra = sorted(present - wanted - allowed_extra)
    if missing or extra:
        raise CheckpointMismatchError(
            f"{source}: HF tensors do not match a {arch.model_type} model with {arch.num_layers} "
            f"layers (tie_word_embeddings={arch.tie_word_embeddings}); "
            f"missing: {missing or 'none'}; unexpected: {extra or 'none'}"
        )
    return {rule.megatron: shard_for_rank(rule, [hf_tensors[n] for n in rule.hf], arch, tp, rank) for rule in rules}


def read_hf_safetensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's ``*.safetensors`` files (single file or sharded)."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors files in the HF checkpoint folder")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def unwrap(model: Any) -> Any:
    """The bare GPTModel inside DDP/Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_hf_into_model(model: Any, checkpoint_dir: str | Path, arch: HFArchitecture, tp: int, rank: int) -> None:
    """Copy an HF checkpoint into this rank's Megatron parameters (in place, under no_grad)."""
    shard = hf_to_megatron_shard(read_hf_safetensors(checkpoint_dir), arch, tp, rank, source=str(checkpoint_dir))
    copy_shard_into_model(model, shard, source=str(checkpoint_dir))


def copy_shard_into_model(model: Any, shard: Mapping[str, torch.Tensor], source: str) -> None:
    params = dict(unwrap(model).named_parameters())
    missing = sorted(set(params) - set(shard))
    extra = sorted(set(shard) - set(params))
    if missing or extra:
        raise CheckpointMismatchError(f"{source}: Megatron parameters missing: {missing or 'none'}; unexpected: {extra or 'none'}")
    with torch.no_grad():
        for name, param in params.items():
            value = shard[name]
            if tuple(value.shape) != tuple(param.shape):
                raise CheckpointMismatchError(
                    f"{source}: {name} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
                )
            param.copy_(value.to(dtype=param.dtype, device=param.device))


# ---- Megatron shards -> HF -----------------------------------------------------------------------


def shards_to_hf(rule: Rule, gather: Callable[[torch.Tensor, int], list[torch.Tensor]], local: torch.Tensor,
                 arch: HFArchitecture, tp: int) -> list[torch.Tensor]:
    """Full HF tensors for ``rule`` from this rank's shard; ``gather(t, dim)`` returns the TP
    shards of ``t`` in rank order (a list of one when tp == 1)."""
    if rule.kind == "replicated":
        return [local]
    if rule.kind == "vocab":
        return [torch.cat(gather(local, 0), dim=0)[: arch.vocab_size]]
    if rule.kind == "row":
        return [torch.cat(gather(local, 1), dim=1)]
    if rule.kind == "qkv":
        return list(split_qkv(torch.cat(gather(local, 0), dim=0), arch))
    if rule.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in gather(local, 0)]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise AssertionError(rule.kind)


def iter_hf_weights(model: Any, arch: HFArchitecture | None = None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF weight, gathering TP shards.

    A collective over the TP group: all its ranks must iterate in step. ``dtype`` casts the
    yielded tensors (default: the parameters' dtype). At TP=1 replicated and unsplit tensors
    are detached views of the parameters: copy before mutating them.
    """
    from megatron.core import parallel_state

    bare = unwrap(model)
    arch = arch or bare.vime_hf_arch
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None

    def gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        if tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts

    params = dict(bare.named_parameters())
    for rule in conversion_rules(arch):
        local = params[rule.megatron].detach()
        for name, tensor in zip(rule.hf, shards_to_hf(rule, gather, local, arch, tp)):
            yield name, tensor if dtype is None else tensor.to(dtype)
