"""Hugging Face <-> Megatron weight conversion, sharded for tensor and expert parallelism. One table
(`conversion_rules`) says, for every Megatron parameter, which HF tensors it is made of, how it is
split over TP ranks and, for an expert, which EP rank holds it; both directions read it."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import load_file

from vime_core.trainer.model import HFArchitecture, padded_vocab_size
from vime_core.weight_sync.buckets import DeferredTensor

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
    expert_owner: int | None = None  # the EP rank holding this expert's weights (None: every EP rank)


def held_by(rule: Rule, ep_rank: int) -> bool:
    """Whether EP rank ``ep_rank`` holds ``rule``'s parameter."""
    return rule.expert_owner is None or rule.expert_owner == ep_rank


def _layer_rules(arch: HFArchitecture, i: int, ep: int) -> list[Rule]:
    m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = h + "self_attn."
    rules = [
        Rule(
            m + "self_attention.linear_qkv.weight",
            (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            "qkv",
        ),
    ]
    if arch.qkv_bias:
        rules.append(
            Rule(
                m + "self_attention.linear_qkv.bias",
                (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"),
                "qkv",
            )
        )
    if arch.qk_norm:
        rules.append(Rule(m + "self_attention.q_layernorm.weight", (attn + "q_norm.weight",), "replicated"))
        rules.append(Rule(m + "self_attention.k_layernorm.weight", (attn + "k_norm.weight",), "replicated"))
    rules.append(Rule(m + "self_attention.linear_proj.weight", (attn + "o_proj.weight",), "row"))
    rules += _moe_rules(arch, m, h, ep) if arch.num_experts else _mlp_rules(m + "mlp.", h + "mlp.")
    rules += [
        Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "replicated"),
        Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "replicated"),
    ]
    return rules


def _mlp_rules(
    m: str, h: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), owner: int | None = None
) -> list[Rule]:
    """One SwiGLU MLP: Megatron prefix ``m``, HF prefix ``h``, HF ``names`` of its gate, up and down
    projections; ``owner``: the EP rank holding it (an expert)."""
    gate, up, down = (f"{h}{name}.weight" for name in names)
    return [
        Rule(m + "linear_fc1.weight", (gate, up), "gate_up", owner),
        Rule(m + "linear_fc2.weight", (down,), "row", owner),
    ]


# model_type -> the sparse block's HF module and its experts' (gate, up, down) projection names, as
# save_pretrained writes them (transformers 5 fuses the experts in memory, not on disk) and vLLM loads them.
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


def _moe_rules(arch: HFArchitecture, m: str, h: str, ep: int) -> list[Rule]:
    """The sparse block (``MOE_HF_NAMES``): the router (``<block>.gate``, [experts, hidden],
    replicated) and each expert's SwiGLU MLP, split over TP like the dense MLP (Megatron's
    ``SequentialMLP`` names; these HF names are also vLLM's). Over ``ep`` EP ranks of L = experts / ep
    local experts each, HF expert e is local expert e mod L of EP rank e // L (Megatron's
    ``local_expert_indices``: EP rank p holds experts p*L .. p*L + L - 1)."""
    block, names = MOE_HF_NAMES[arch.model_type]
    rules = [Rule(m + "mlp.router.weight", (f"{h}{block}.gate.weight",), "replicated")]
    local = arch.num_experts // ep
    for e in range(arch.num_experts):
        owner = e // local if ep > 1 else None
        rules += _mlp_rules(f"{m}mlp.experts.local_experts.{e % local}.", f"{h}{block}.experts.{e}.", names, owner)
    return rules


def conversion_rules(arch: HFArchitecture, ep: int = 1) -> list[Rule]:
    """All rules in HF checkpoint order (embeddings, layers, final norm, LM head), the experts' named
    as over ``ep`` EP ranks (``_moe_rules``; ``held_by`` picks one rank's).

    Layouts (tp ranks, g KV groups, n query heads): fused QKV is, per KV group, its n/g query heads, then
    its key and value heads, groups contiguous, so rank r holds the r-th of tp dim-0 chunks (Qwen2's
    biases alike); gate/up: rank r holds [gate_r; up_r]; o_proj and down_proj: dim-1 chunks; embeddings
    and LM head: the vocabulary padded with zero rows to a multiple of tp, then dim-0 chunks; norms
    (Qwen3's q/k norms too) are replicated."""
    rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    if arch.num_experts % ep:
        raise CheckpointMismatchError(
            f"expert_model_parallel_size={ep} does not divide the model's num_experts={arch.num_experts}"
        )
    for i in range(arch.num_layers):
        rules += _layer_rules(arch, i, ep)
    rules.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not arch.tie_word_embeddings:
        rules.append(Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


# ---- fused QKV layout ------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: HFArchitecture) -> torch.Tensor:
    """[q; k; v] (HF, head-major) -> Megatron's per-KV-group layout [q_g.., k_g, v_g] x groups.

    The number of groups is read from ``k`` (``k.shape[0] / head_dim``), so the same call fuses
    the full tensors or one TP rank's consecutive groups."""
    d = arch.head_dim
    g = k.shape[0] // d
    per_group = arch.num_heads // arch.num_kv_heads
    rest = q.shape[1:]
    fused = torch.cat([q.reshape(g, per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1)
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


def chunk_bounds(n: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``torch.chunk(range(n), tp)[rank]`` (chunks of ``ceil(n / tp)``)."""
    size = -(-n // tp)
    start = min(n, rank * size)
    return start, min(n, start + size)


def rank_range(
    rule: Rule, j: int, shape: tuple[int, ...], arch: HFArchitecture, tp: int, rank: int
) -> tuple[int, int, int] | None:
    """``(dim, start, end)``: the part of HF tensor ``rule.hf[j]`` (of ``shape``) that TP rank
    ``rank`` holds; None when it holds all of it. Every split is one contiguous range, so a
    reader can fetch just that part (``safe_open(...).get_slice``)."""
    if rule.kind == "replicated":
        return None
    if rule.kind == "vocab":  # the padded vocabulary's chunk, less the padding rows
        start, end = chunk_bounds(padded_vocab_size(arch.vocab_size, tp), tp, rank)
        return 0, min(start, shape[0]), min(end, shape[0])
    if rule.kind == "row":
        return (1, *chunk_bounds(shape[1], tp, rank))
    if rule.kind == "qkv":  # whole KV groups: rows of n/g query heads (q) or of one head (k, v)
        if arch.num_kv_heads % tp:
            raise CheckpointMismatchError(f"{arch.num_kv_heads} KV heads cannot be split over TP={tp} ranks")
        g0, g1 = chunk_bounds(arch.num_kv_heads, tp, rank)
        rows = arch.head_dim * (arch.num_heads // arch.num_kv_heads if j == 0 else 1)
        return 0, g0 * rows, g1 * rows
    if rule.kind == "gate_up":
        return (0, *chunk_bounds(shape[0], tp, rank))
    raise AssertionError(rule.kind)


def assemble_shard(rule: Rule, parts: list[torch.Tensor], arch: HFArchitecture, tp: int, rank: int) -> torch.Tensor:
    """This rank's Megatron parameter from the parts ``rank_range`` selected of each HF tensor."""
    if rule.kind in ("replicated", "row"):
        return parts[0]
    if rule.kind == "vocab":
        start, end = chunk_bounds(padded_vocab_size(arch.vocab_size, tp), tp, rank)
        return pad_vocab(parts[0], end - start)
    if rule.kind == "qkv":
        return fuse_qkv(*parts, arch)
    if rule.kind == "gate_up":
        return torch.cat(parts, dim=0)
    raise AssertionError(rule.kind)


def narrow_to(tensor: torch.Tensor, part: tuple[int, int, int] | None) -> torch.Tensor:
    return tensor if part is None else tensor.narrow(part[0], part[1], part[2] - part[1])


def shard_for_rank(rule: Rule, hf: list[torch.Tensor], arch: HFArchitecture, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's slice of the Megatron parameter ``rule.megatron`` (from full HF tensors)."""
    parts = [narrow_to(t, rank_range(rule, j, tuple(t.shape), arch, tp, rank)) for j, t in enumerate(hf)]
    return assemble_shard(rule, parts, arch, tp, rank)


def check_hf_names(names: Iterable[str], arch: HFArchitecture, source: str) -> None:
    """Raise ``CheckpointMismatchError`` naming every missing and unexpected HF tensor."""
    rules = conversion_rules(arch)
    wanted = {name for rule in rules for name in rule.hf}
    allowed_extra = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    present = {n for n in names if not n.endswith(IGNORED_HF_SUFFIXES)}
    missing = sorted(wanted - present)
    extra = sorted(present - wanted - allowed_extra)
    if missing or extra:
        raise CheckpointMismatchError(
            f"{source}: HF tensors do not match a {arch.model_type} model with {arch.num_layers} "
            f"layers (tie_word_embeddings={arch.tie_word_embeddings}); "
            f"missing: {missing or 'none'}; unexpected: {extra or 'none'}"
        )


def hf_to_megatron_shard(
    hf_tensors: Mapping[str, torch.Tensor],
    arch: HFArchitecture,
    tp: int,
    rank: int,
    source: str = "checkpoint",
    ep: int = 1,
    ep_rank: int = 0,
) -> dict[str, torch.Tensor]:
    """Megatron-named tensors for TP rank ``rank`` (of EP rank ``ep_rank``: its experts) from full HF
    tensors in memory; raises ``CheckpointMismatchError`` naming every missing and unexpected HF
    tensor of ``source``."""
    check_hf_names(hf_tensors, arch, source)
    return {
        rule.megatron: shard_for_rank(rule, [hf_tensors[n] for n in rule.hf], arch, tp, rank)
        for rule in conversion_rules(arch, ep)
        if held_by(rule, ep_rank)
    }


# ---- reading safetensors checkpoints -----------------------------------------------------------

SAFETENSORS_INDEX = "model.safetensors.index.json"


def tensor_files(checkpoint_dir: str | Path) -> dict[str, Path]:
    """Which file holds each tensor: the index's ``weight_map`` when the folder has
    ``model.safetensors.index.json``, else the headers of its ``*.safetensors`` files (one file
    is the unsharded case)."""
    folder = Path(checkpoint_dir)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointMismatchError(f"{index}: no 'weight_map' (tensor name -> shard file)")
        located = {name: folder / file for name, file in weight_map.items()}
        absent = sorted({str(f.name) for f in located.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(f"{index} names shard files that are not in the folder: {absent}")
        return located
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors files in the HF checkpoint folder")
    located = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            located.update((name, f) for name in handle.keys())
    return located


def read_hf_safetensors(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, whole (single file or sharded): for tests and tools; the
    trainer reads its TP slices with ``iter_megatron_shard``."""
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(set(tensor_files(checkpoint_dir).values())):
        tensors.update(load_file(str(f)))
    return tensors


def iter_megatron_shard(
    checkpoint_dir: str | Path, arch: HFArchitecture, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(megatron_name, tensor)`` of TP rank ``rank`` of EP rank ``ep_rank`` (only its experts
    are read), reading the checkpoint shard file by shard file.

    Each file is opened once (``safe_open``, memory-mapped) and each HF tensor is read through
    ``get_slice`` as just the range this rank holds (``rank_range``): a rank never materialises
    a TP-split tensor whole. A parameter is yielded as soon as its last HF tensor is read; only
    the parts of parameters whose tensors span files wait (a few layers' worth at most)."""
    source = str(checkpoint_dir)
    located = tensor_files(checkpoint_dir)
    check_hf_names(located, arch, source)
    rules = [rule for rule in conversion_rules(arch, ep) if held_by(rule, ep_rank)]
    by_file: dict[Path, list[tuple[int, int]]] = {}
    for i, rule in enumerate(rules):
        for j, name in enumerate(rule.hf):
            by_file.setdefault(located[name], []).append((i, j))
    waiting: dict[int, list[torch.Tensor | None]] = {}
    for path in sorted(by_file):
        with safe_open(str(path), framework="pt") as handle:
            for i, j in by_file[path]:
                rule = rules[i]
                view = handle.get_slice(rule.hf[j])
                shape = tuple(view.get_shape())
                if rule.kind == "vocab" and shape[0] != arch.vocab_size:
                    raise CheckpointMismatchError(
                        f"{source}: {rule.hf[j]} has {shape[0]} rows, config.json says vocab_size={arch.vocab_size}"
                    )
                part = rank_range(rule, j, shape, arch, tp, rank)
                if part is None:
                    tensor = view[:]
                else:
                    dim, start, end = part
                    tensor = view[start:end] if dim == 0 else view[:, start:end]
                parts = waiting.setdefault(i, [None] * len(rule.hf))
                parts[j] = tensor
                if all(t is not None for t in parts):
                    del waiting[i]
                    yield rule.megatron, assemble_shard(rule, parts, arch, tp, rank)


def unwrap(model: Any) -> Any:
    """The bare GPTModel inside DDP/Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_hf_into_model(
    model: Any, checkpoint_dir: str | Path, arch: HFArchitecture, tp: int, rank: int, ep: int = 1, ep_rank: int = 0
) -> None:
    """Copy an HF checkpoint into this rank's Megatron parameters (in place, under no_grad),
    one parameter at a time as ``iter_megatron_shard`` reads it."""
    source = str(checkpoint_dir)
    held = {rule.megatron for rule in conversion_rules(arch, ep) if held_by(rule, ep_rank)}
    params = _checked_params(model, held, source)
    with torch.no_grad():
        for name, value in iter_megatron_shard(checkpoint_dir, arch, tp, rank, ep, ep_rank):
            _copy_param(params[name], name, value, source)


def copy_shard_into_model(model: Any, shard: Mapping[str, torch.Tensor], source: str) -> None:
    params = _checked_params(model, set(shard), source)
    with torch.no_grad():
        for name, param in params.items():
            _copy_param(param, name, shard[name], source)


def _checked_params(model: Any, names: set[str], source: str) -> dict[str, torch.nn.Parameter]:
    params = dict(unwrap(model).named_parameters())
    missing = sorted(set(params) - names)
    extra = sorted(names - set(params))
    if missing or extra:
        raise CheckpointMismatchError(
            f"{source}: Megatron parameters missing: {missing or 'none'}; unexpected: {extra or 'none'}"
        )
    return params


def _copy_param(param: torch.nn.Parameter, name: str, value: torch.Tensor, source: str) -> None:
    if tuple(value.shape) != tuple(param.shape):
        raise CheckpointMismatchError(
            f"{source}: {name} has shape {tuple(value.shape)}, the model expects {tuple(param.shape)}"
        )
    param.copy_(value.to(dtype=param.dtype, device=param.device))


# ---- Megatron shards -> HF -----------------------------------------------------------------------


def shards_to_hf(
    rule: Rule,
    gather: Callable[[torch.Tensor, int], list[torch.Tensor]],
    local: torch.Tensor,
    arch: HFArchitecture,
    tp: int,
) -> list[torch.Tensor]:
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


def iter_hf_weights(
    model: Any, arch: HFArchitecture | None = None, dtype: torch.dtype | None = None, defer_merge: bool = False
) -> Iterator[tuple[str, torch.Tensor | DeferredTensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF weight, gathering TP shards and, with expert
    parallelism, each expert from the EP rank holding it (a broadcast over the EP group), once.
    ``defer_merge``: a LoRA layer's merged weights come as `DeferredTensor`s where no collective
    is needed to make them (TP=1, not an expert from another EP rank), made by `iter_buckets` as
    each bucket fills (a publish then holds one bucket of merged weights, not the model's).

    A collective over the TP group and the EP group: all their ranks (``ParallelLayout.holds_first_copy``)
    must iterate in step. ``dtype`` casts the yielded tensors (default: the parameters' dtype). A layer
    with a LoRA adapter yields its merged weight, so engines and exports see one plain model. At TP=1
    replicated and unsplit tensors (an expert on its owner too) are detached views of the parameters:
    copy before mutating them.
    """
    bare = unwrap(model)
    arch = arch or bare.vime_hf_arch
    tp = parallel_state.get_tensor_model_parallel_world_size()
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    ep = parallel_state.get_expert_model_parallel_world_size() if arch.num_experts else 1
    ep_rank = parallel_state.get_expert_model_parallel_rank() if ep > 1 else 0
    ep_group = parallel_state.get_expert_model_parallel_group() if ep > 1 else None

    def gather(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        if tp == 1:
            return [t]
        parts = [torch.empty_like(t) for _ in range(tp)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts

    def from_owner(t: torch.Tensor, owner: int) -> torch.Tensor:
        """The owner's tensor of the same local name (the same shape) on every EP rank."""
        out = t.contiguous() if owner == ep_rank else torch.empty_like(t)
        torch.distributed.broadcast(out, group=ep_group, group_src=owner)
        return out

    params = dict(bare.named_parameters())
    for rule in conversion_rules(arch, ep):
        local = params[rule.megatron].detach()
        if rule.expert_owner is not None:
            local = from_owner(local, rule.expert_owner)
        module, _, leaf = rule.megatron.rpartition(".")
        adapter = getattr(bare.get_submodule(module), "lora", None) if leaf == "weight" else None
        if adapter is not None and defer_merge and dtype is None and tp == 1 and rule.expert_owner is None:
            yield from _deferred_merge(rule, adapter, local, arch)
            continue
        if adapter is not None:  # LoRA (trainer/lora.py): the merged weight W + s B A, split as W
            local = adapter.merged(local)
        for name, tensor in zip(rule.hf, shards_to_hf(rule, gather, local, arch, tp)):
            yield name, tensor if dtype is None else tensor.to(dtype)


def _deferred_merge(
    rule: Rule, adapter: Any, local: torch.Tensor, arch: HFArchitecture
) -> Iterator[tuple[str, DeferredTensor]]:
    """At TP=1: each HF tensor of an adapted layer as a `DeferredTensor` of its part of the merged
    W + s B A (a fused layer's merge is made once per part: q/k/v, gate/up; a rank-r product each)."""

    def one(t: torch.Tensor, dim: int) -> list[torch.Tensor]:
        return [t]

    def part(i: int) -> torch.Tensor:
        return shards_to_hf(rule, one, adapter.merged(local), arch, 1)[i]

    shapes = shards_to_hf(rule, one, torch.empty_like(local, device="meta"), arch, 1)
    for i, (name, meta) in enumerate(zip(rule.hf, shapes)):
        yield name, DeferredTensor(meta.shape, meta.dtype, functools.partial(part, i))
