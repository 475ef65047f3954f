"""HF <-> Megatron layouts without a process group: fused QKV, gate/up, row and vocab splits,
and the missing/extra-tensor errors."""

from __future__ import annotations

import pytest
import torch

from vime_core.demo.model import tiny_config
from vime_core.trainer.hf_convert import (
    CheckpointMismatchError,
    conversion_rules,
    fuse_qkv,
    hf_to_megatron_shard,
    shards_to_hf,
    split_qkv,
)
from vime_core.trainer.model import architecture_from_hf


def _random_hf(arch, tie):
    """Random tensors of the right shapes for every HF name the rules expect."""
    gen = torch.Generator().manual_seed(0)
    h, d = arch.hidden_size, arch.head_dim
    shapes = {
        "q_proj.weight": (arch.num_heads * d, h),
        "k_proj.weight": (arch.num_kv_heads * d, h),
        "v_proj.weight": (arch.num_kv_heads * d, h),
        "q_proj.bias": (arch.num_heads * d,),
        "k_proj.bias": (arch.num_kv_heads * d,),
        "v_proj.bias": (arch.num_kv_heads * d,),
        "o_proj.weight": (h, arch.num_heads * d),
        "gate_proj.weight": (arch.ffn_hidden_size, h),
        "up_proj.weight": (arch.ffn_hidden_size, h),
        "down_proj.weight": (h, arch.ffn_hidden_size),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "embed_tokens.weight": (arch.vocab_size, h),
        "lm_head.weight": (arch.vocab_size, h),
    }
    out = {}
    for rule in conversion_rules(arch):
        for name in rule.hf:
            key = ".".join(name.split(".")[-2:])
            out[name] = torch.randn(*shapes.get(key, (h,)), generator=gen)
    return out


def test_fused_qkv_layout_is_per_kv_group():
    arch = architecture_from_hf(tiny_config("qwen2", num_heads=4, num_kv_heads=2, head_dim=1, hidden_size=1))
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # 4 query heads of dim 1
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = fuse_qkv(q, k, v, arch)
    # group 0: q0 q1 k0 v0, group 1: q2 q3 k1 v1
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused, arch), (q, k, v)))


@pytest.mark.parametrize("family,tie,tp", [("qwen2", True, 2), ("qwen3", False, 2), ("llama", False, 1)])
def test_shard_then_gather_is_exact(family, tie, tp):
    arch = architecture_from_hf(tiny_config(family, tie_word_embeddings=tie, num_heads=4, num_kv_heads=2))
    hf = _random_hf(arch, tie)
    shards = [hf_to_megatron_shard(hf, arch, tp, r) for r in range(tp)]
    for rule in conversion_rules(arch):
        locals_ = [s[rule.megatron] for s in shards]

        def gather(t, dim, locals_=locals_):
            return locals_

        for name, tensor in zip(rule.hf, shards_to_hf(rule, gather, locals_[0], arch, tp)):
            assert torch.equal(tensor, hf[name]), name


def test_vocab_rows_are_padded_per_rank():
    arch = architecture_from_hf(tiny_config("qwen3"))  # 19 tokens
    hf = _random_hf(arch, True)
    last = hf_to_megatron_shard(hf, arch, 2, 1)["embedding.word_embeddings.weight"]
    assert last.shape[0] == 10 and last[-1].abs().sum() == 0


def test_missing_and_extra_tensors_are_named():
    arch = architecture_from_hf(tiny_config("qwen3", tie_word_embeddings=False))
    hf = _random_hf(arch, False)
    hf.pop("model.layers.1.mlp.up_proj.weight")
    hf["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointMismatchError) as err:
        hf_to_megatron_shard(hf, arch, 1, 0, source="ckpt-dir")
    text = str(err.value)
    assert "ckpt-dir" in text
    assert "missing: ['model.layers.1.mlp.up_proj.weight']" in text
    assert "unexpected: ['model.layers.7.mlp.up_proj.weight']" in text


def test_tied_checkpoint_may_carry_lm_head():
    arch = architecture_from_hf(tiny_config("qwen3", tie_word_embeddings=True))
    hf = _random_hf(arch, True) | {"lm_head.weight": torch.zeros(19, arch.hidden_size)}
    assert "output_layer.weight" not in hf_to_megatron_shard(hf, arch, 1, 0)
