"""A tiny Qwen3/Qwen2/Llama-style causal LM and a character-level tokenizer over the synthetic tasks'
alphabet, saved as a normal Hugging Face checkpoint that transformers, vLLM and vime's Megatron loader
read; deterministic per seed and family, so tests and the default job share one cached folder."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]
CHARACTERS = list("0123456789+-=*> ")
VOCAB = SPECIAL_TOKENS + CHARACTERS  # 19 tokens
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

FAMILIES = {
    # family -> (architecture, model_type, extra config)
    "qwen3": ("Qwen3ForCausalLM", "qwen3", {}),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", {}),
    "llama": ("LlamaForCausalLM", "llama", {"mlp_bias": False, "attention_bias": False}),
}


def tiny_config(
    family: str = "qwen3",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 256,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 512,
    vocab_size: int | None = None,
    torch_dtype: str = "float32",
) -> dict:
    """config.json contents. The default shape (0.33M parameters) is the embedded default job's
    model: the smallest shape that learns the "a+b=" task from its binary reward and keeps what it
    learned (docs/measurements.md has the default job's reward gain)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    arch, model_type, extra = FAMILIES[family]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab_size or len(VOCAB),
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": torch_dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if model_type == "qwen2":
        cfg["attention_bias"] = True  # Qwen2 has q/k/v biases
    cfg.update(extra)
    return cfg


def build_tokenizer(out_dir: str | Path, vocab_size: int | None = None):
    """A character-level WordLevel tokenizer saved as tokenizer.json + tokenizer_config.json.
    `vocab_size` beyond the alphabet adds filler tokens `<|fN|>` that no text encodes to, so a
    model with a real-sized vocabulary (e.g. Qwen's 151936) decodes every id it samples."""
    # boundary: the driver imports this module (run_assets.py); tokenizers, torch and transformers only to build
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(VOCAB)}
    for i in range(len(VOCAB), vocab_size or len(VOCAB)):
        vocab[f"<|f{i}|>"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<pad>",
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    fast.save_pretrained(str(out_dir))
    return fast


def build_tiny_model(out_dir: str | Path, family: str = "qwen3", seed: int = 0, **shape) -> Path:
    """Build (or reuse) a randomly initialised model and its tokenizer in `out_dir`. `shape`:
    `tiny_config`'s arguments (a larger shape and vocab_size give e.g. a Qwen2-0.5B-shaped
    model on the same task alphabet); weights are written in `torch_dtype`."""
    out = Path(out_dir)
    cfg_dict = tiny_config(family, **shape)
    marker = out / "vime_tiny.json"
    want = {"family": family, "seed": seed, "config": cfg_dict}
    if marker.exists() and json.loads(marker.read_text()) == want and (out / "model.safetensors").exists():
        return out
    # boundary: the driver imports this module (run_assets.py) and reuses a built model without torch
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    config = AutoConfig.from_pretrained(str(out))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg_dict["torch_dtype"]))
    model.save_pretrained(str(out), safe_serialization=True)
    build_tokenizer(out, cfg_dict["vocab_size"])
    marker.write_text(json.dumps(want, indent=2))
    return out
