"""Tiny random MoE checkpoints (transformers' own ``Qwen3MoeForCausalLM`` and ``MixtralForCausalLM``)
on the demo alphabet: the MoE trainer tests' fixtures, as ``tests/integration/trainer/conftest.tiny_checkpoint``
is the dense families'."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from vime_core.demo.model import VOCAB, build_tokenizer, tiny_config


def tiny_moe_config(norm_topk_prob: bool = True, tie_word_embeddings: bool = False, **changes) -> dict:
    """config.json of a 2-layer Qwen3-MoE: hidden 64, 4 heads / 2 KV heads of dim 32 (TP=2 splits
    them; vLLM's CPU attention has no head_dim 16), 8 experts of intermediate size 32, top-2 routing."""
    cfg = tiny_config(
        "qwen3", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=tie_word_embeddings
    )
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        intermediate_size=96,  # a dense MLP's size: unused while every layer is sparse
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        router_aux_loss_coef=0.001,
        output_router_logits=False,
    )
    cfg.update(changes)
    return cfg


def tiny_mixtral_config(tie_word_embeddings: bool = False, **changes) -> dict:
    """config.json of a 2-layer Mixtral with the Qwen3-MoE fixture's shape: hidden 64, 4 heads / 2 KV
    heads of dim 32, 8 experts of intermediate size 32 (Mixtral's ``intermediate_size`` is each
    expert's), top-2 routing; Llama attention (no q/k norms, no biases)."""
    cfg = tiny_config(
        "llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=tie_word_embeddings
    )
    for key in ("mlp_bias", "attention_bias"):  # Llama's fields; Mixtral has neither
        cfg.pop(key, None)
    cfg.update(
        architectures=["MixtralForCausalLM"],
        model_type="mixtral",
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        router_aux_loss_coef=0.001,
        output_router_logits=False,
        sliding_window=None,
    )
    cfg.update(changes)
    return cfg


def tiny_mixtral_checkpoint(cache_dir: Path, tie: bool = False, seed: int = 1) -> Path:
    """Build (or reuse) the Mixtral checkpoint and a character tokenizer under ``cache_dir/models``."""
    out = Path(cache_dir) / "models" / f"trainer-mixtral-{'tied' if tie else 'untied'}"
    return _saved(out, tiny_mixtral_config(tie), seed)


def tiny_moe_checkpoint(
    cache_dir: Path, norm_topk_prob: bool = True, tie: bool = False, seed: int = 1, top_k: int = 2
) -> Path:
    """Build (or reuse) the checkpoint and a character tokenizer under ``cache_dir/models``."""
    cfg = tiny_moe_config(norm_topk_prob, tie, num_experts_per_tok=top_k)
    out = (
        Path(cache_dir)
        / "models"
        / f"trainer-qwen3moe-{'norm' if norm_topk_prob else 'raw'}-{'tied' if tie else 'untied'}"
        f"{'' if top_k == 2 else f'-top{top_k}'}"
    )
    return _saved(out, cfg, seed)


def _saved(out: Path, cfg: dict, seed: int) -> Path:
    """``out`` holding transformers' model of ``cfg`` at ``seed`` (``save_pretrained``), unless the
    folder already holds exactly that."""
    marker = out / "vime_tiny.json"
    want = {"seed": seed, "config": cfg}
    if marker.exists() and json.loads(marker.read_text()) == want and (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(out)), dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out, len(VOCAB))
    marker.write_text(json.dumps(want, indent=2))
    return out


def random_hf_tensors(arch, names, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under HF names ``names`` of an MoE ``arch`` (``HFArchitecture``), each in the
    shape its name has in a checkpoint (either family's expert names)."""
    h, d, f = arch.hidden_size, arch.head_dim, arch.moe_ffn_hidden_size
    shapes = {
        "q_proj": (arch.num_heads * d, h),
        "k_proj": (arch.num_kv_heads * d, h),
        "v_proj": (arch.num_kv_heads * d, h),
        "o_proj": (h, arch.num_heads * d),
        **dict.fromkeys(("gate_proj", "up_proj", "w1", "w3"), (f, h)),
        **dict.fromkeys(("down_proj", "w2"), (h, f)),
        "gate": (arch.num_experts, h),
        "q_norm": (d,),
        "k_norm": (d,),
        "embed_tokens": (arch.vocab_size, h),
        "lm_head": (arch.vocab_size, h),
    }
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*shapes.get(n.split(".")[-2], (h,)), generator=gen) for n in names}
