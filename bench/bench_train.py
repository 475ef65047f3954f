"""Train tokens/s of vime's Megatron step against a plain transformers model of the same shape and
batch, measured in the same run: `MegatronTrainer.train` (DP schedule, THD packing, SDPA, the
registered PPO-clip loss, Megatron's DDP and Adam) against a padded transformers forward, the same
loss inline, clip_grad_norm_ and torch AdamW. Interleaved repeats; ratio = baseline_s / vime_s.

    bench/run.py train                                          # CPU, fp32
    bench/run.py train --device cuda --dtype bf16 --hidden 1024 --layers 12 ..."""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import time

from bench_math import median_seconds  # noqa: E402
from gpu_common import pairs_of_samples  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config

from vime_core.demo.settings import demo_config
from vime_core.trainer.parallel import free_port
from vime_core.trainer.trainer import MegatronTrainer


def write_checkpoint(out: Path, args: argparse.Namespace) -> Path:
    """A random Qwen3-style HF checkpoint of the requested shape (no tokenizer needed)."""
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.seq * 2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        attention_dropout=0.0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def make_batch(args: argparse.Namespace) -> dict[str, list]:
    gen = torch.Generator().manual_seed(1)
    n, seq, resp = args.samples, args.seq, args.response
    tokens = torch.randint(0, args.vocab, (n, seq), generator=gen).tolist()
    adv = [1.0 if i % 2 == 0 else -1.0 for i in range(n)]
    return {
        "tokens": tokens,
        "response_length": [resp] * n,
        "total_length": [seq] * n,
        "loss_mask": [[1] * resp for _ in range(n)],
        "advantage": adv,
        "reward": adv,
        "rollout_log_probs": [[-1.0] * resp for _ in range(n)],
    }


def vime_trainer(ckpt: Path, storage: Path, args: argparse.Namespace):
    cfg = demo_config(
        **pairs_of_samples(args.samples),
        num_steps_per_rollout=1,
        micro_batch_size=args.micro_batch,
        lr=1e-6,
        clip_grad=1.0,
        hf_checkpoint=str(ckpt),
        storage_uri=str(storage),
        device=args.device,
        bf16=args.dtype == "bf16",
        colocate=False,
        rollout_num_gpus=1,
    )
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", free_port())
    trainer.init()
    return trainer


def baseline_step_fn(ckpt: Path, batch: dict[str, list], args: argparse.Namespace):
    """One plain-transformers training step over the batch's micro-batches."""
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype, attn_implementation="sdpa").to(args.device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, betas=(0.9, 0.98), weight_decay=0.0)
    tokens = torch.tensor(batch["tokens"], device=args.device)
    adv = torch.tensor(batch["advantage"], device=args.device)
    resp, mb = args.response, args.micro_batch
    total_tokens = args.samples * resp

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for start in range(0, args.samples, mb):
            ids = tokens[start : start + mb]
            logits = model(input_ids=ids).logits[:, -resp - 1 : -1].float()
            lp = logits.log_softmax(-1).gather(-1, ids[:, -resp:].unsqueeze(-1)).squeeze(-1)
            ratio = (lp - lp.detach()).exp()
            a = adv[start : start + mb, None]
            pg = torch.maximum(-ratio * a, -ratio.clamp(0.8, 1.2) * a)
            (pg.sum() / total_tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def sleep_wake(trainer, step) -> dict:
    """GPU only: bytes freed by trainer.sleep() (offload to CPU) and the time of sleep and wake;
    a training step after wake checks the state came back whole."""
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    start = time.perf_counter()
    slept = trainer.sleep()
    sleep_s = time.perf_counter() - start
    start = time.perf_counter()
    woke = trainer.wake()
    wake_s = time.perf_counter() - start
    step()
    return {
        "allocated_before_bytes": allocated,
        "freed_bytes": slept["freed_bytes"],
        "restored_bytes": woke["allocated_bytes"],
        "sleep_s": sleep_s,
        "wake_s": wake_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--response", type=int, default=192)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    warnings.filterwarnings("ignore")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "model", args)
        batch = make_batch(args)
        trainer = vime_trainer(ckpt, Path(tmp) / "runs", args)
        counter = iter(range(10**9))
        last: dict = {}

        def vime_step() -> None:
            last.update(trainer.train(next(counter), batch))

        baseline = baseline_step_fn(ckpt, batch, args)
        sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

        def timed(fn):
            def run() -> None:
                fn()
                sync()

            return run

        vime_s, base_s = median_seconds(timed(vime_step), timed(baseline), repeats=args.repeats)
        params = sum(p.numel() for p in trainer.model.parameters())
        memory = sleep_wake(trainer, vime_step) if args.device == "cuda" else None

    tokens = args.samples * args.seq
    result = {
        "bench": "bench_train",
        "machine": {
            "platform": platform.platform(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "shape": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")},
        "parameters": params,
        "dtype": args.dtype,
        "batch": {
            "samples": args.samples,
            "seq": args.seq,
            "response": args.response,
            "micro_batch": args.micro_batch,
            "tokens": tokens,
        },
        "repeats": args.repeats,
        "baseline_s": base_s,
        "vime_s": vime_s,
        "baseline_tokens_per_s": tokens / base_s,
        "vime_tokens_per_s": tokens / vime_s,
        "ratio": base_s / vime_s,
        "target_ratio": 0.9,
        "vime_last_metrics": {k: last[k] for k in ("loss", "grad_norm", "entropy") if k in last},
        "sleep_wake": memory,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
