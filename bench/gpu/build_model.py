"""A random Qwen-shaped model on the arithmetic task's alphabet (gpu_common.SHAPES, Qwen's vocabulary
size with filler tokens, bf16) and a prompt set, for GPU runs without a hub. --prompt-noise LO,HI
spreads the prompt lengths; --prompt-tokens N makes every prompt exactly N tokens. A dense shape up
to 5e9 parameters is transformers' own initialisation (vime_core.demo.model.build_tiny_model); an
MoE shape or a larger dense one is gpu_common.write_random_checkpoint's N(0, 0.02) tensors, drawn on
the GPU when there is one (a 3B model through transformers' CPU initialisation takes minutes).

    python bench/gpu/build_model.py --shape 0.5b --out /tmp/m --prompts /tmp/p.jsonl --prompt-noise 16,500"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
import gpu_common  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from vime_core.demo.model import BOS_ID, EOS_ID, PAD_ID, build_tiny_model, build_tokenizer  # noqa: E402
from vime_core.demo.task import make_rows  # noqa: E402


# transformers' CPU initialisation of a larger dense shape takes minutes (14b: 14.8e9 parameters);
# its N(0, 0.02) weights and unit norms are what write_random_checkpoint draws on the GPU
CPU_INIT_MAX_PARAMETERS = 5e9


def build(shape: str, out: Path, seed: int) -> Path:
    """The checkpoint folder of ``shape`` with the alphabet's tokenizer (module docstring)."""
    s = gpu_common.shape_spec(shape)
    if (
        gpu_common.is_moe(s)
        or gpu_common.parameter_counts(gpu_common.hf_config(shape))["total"] > CPU_INIT_MAX_PARAMETERS
    ):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return gpu_common.write_random_checkpoint(
            out,
            shape,
            seed,
            device,
            # the tokenizer's special ids, so that the engines stop at its <eos>
            config_changes=dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID),
            extra_files=lambda folder: build_tokenizer(folder, s["vocab_size"]),
        )
    return build_tiny_model(
        out,
        family=s["model_type"],
        seed=seed,
        hidden_size=s["hidden_size"],
        num_layers=s["num_hidden_layers"],
        num_heads=s["num_attention_heads"],
        num_kv_heads=s["num_key_value_heads"],
        head_dim=s["head_dim"],
        intermediate_size=s["intermediate_size"],
        tie_word_embeddings=s["tie_word_embeddings"],
        max_position_embeddings=32768,
        vocab_size=s["vocab_size"],
        torch_dtype="bfloat16",
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b", help="a name of gpu_common.SHAPES, or NAME@LAYERS")
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", default="")
    p.add_argument("--prompt-noise", default="", help="LO,HI characters of noise before each prompt")
    p.add_argument("--prompt-tokens", type=int, default=0, help="every prompt exactly this many tokens")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    path = build(a.shape, Path(a.out), a.seed)
    print(json.dumps({"model": str(path)}))
    if a.prompts:
        rng = random.Random(a.seed)
        lo, hi = (int(x) for x in a.prompt_noise.split(",")) if a.prompt_noise else (0, 0)
        rows = []
        tokenizer = None
        if a.prompt_tokens:
            tokenizer = AutoTokenizer.from_pretrained(path)
        for row in make_rows():
            size = rng.randint(lo, hi)
            if tokenizer is not None:  # character-level vocabulary: one noise character, one token
                size = a.prompt_tokens - len(tokenizer.encode(row["prompt"]))
            # no spaces when counting tokens: the larger vocabularies' tokenizer drops them
            noise = "".join(
                rng.choice("0123456789+-*>" if tokenizer is not None else "0123456789+-*> ") for _ in range(size)
            )
            rows.append({**row, "prompt": noise + row["prompt"]})
            if tokenizer is not None and len(tokenizer.encode(rows[-1]["prompt"])) != a.prompt_tokens:
                raise SystemExit(f"prompt {row['prompt']!r}: cannot make it {a.prompt_tokens} tokens long")
        Path(a.prompts).parent.mkdir(parents=True, exist_ok=True)
        Path(a.prompts).write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(json.dumps({"prompts": a.prompts, "rows": len(rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
