"""Shared pieces of the GPU benchmarks: model shapes (Qwen-style HF configs built here, no hub), random
HF checkpoints, FLOP counts and timing. FLOPs of one training step over samples of lengths s_i
(T = sum_i s_i tokens, N the parameters that take part in a matmul, the LM head included):

    dense = 6 * N * T,   attention = sum_i 6 * L * (heads * head_dim) * s_i^2 (causal),
    MFU   = flops / step_time / PEAK_BF16_FLOPS (the GPU's datasheet dense bf16 peak)

A forward-only pass is a third of that; `head_tokens` counts the LM head on the R response tokens
only: 6 * (N - V * h) * T + 6 * V * h * R.

An MoE shape (qwen3_moe: E experts of intermediate size f_e, top k per token) counts N on the
*active* parameters, those one token's matmuls touch: N = matmul - L * (E - k) * 3 * h * f_e, i.e.
attention, k of the E experts, the router (E x h, every token) and the LM head as for a dense shape;
its MFU is "MFU on active parameters" (`parameter_counts`' "active")."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from vime_core.demo.settings import demo_config

PEAK_BF16_FLOPS = 989e12

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
    "0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "1.5b": dict(
        model_type="qwen2",
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=8960,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "4b": dict(
        model_type="qwen3",
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # full fine-tuning needs ~18 bytes a parameter (bf16 weights, fp32 main copy, gradient and two
    # Adam moments): 8b does not fit one H200, 14b is the LoRA case of issue 41
    "8b": dict(
        model_type="qwen3",
        hidden_size=4096,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    # a Qwen3-30B-A3B layer (hidden 2048, 32/4 heads, experts of 768, top-8) with 32 experts and 16
    # layers: 3.0B parameters, 1.2B active, trained in full beside its engine on one GPU
    "moe": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,  # a dense MLP's size: unused while every layer is sparse
        moe_intermediate_size=768,
        num_experts=32,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny-moe": dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        vocab_size=1000,
        tie_word_embeddings=True,
    ),
    "14b": dict(
        model_type="qwen3",
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=17408,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
}


ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# qwen3_moe's fields beside the shape: every layer sparse (vime refuses dense layers between them),
# no router logits in the forward's output
MOE_FIELDS = dict(decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001, output_router_logits=False)


def is_moe(cfg: dict[str, Any]) -> bool:
    return cfg["model_type"] == "qwen3_moe"


def is_shape(shape: str) -> bool:
    """A name of SHAPES, or NAME@L: that shape with L layers (the largest-shape search's candidates)."""
    base, at, layers = shape.partition("@")
    return base in SHAPES and (not at or (layers.isdigit() and int(layers) > 0))


def shape_spec(shape: str) -> dict[str, Any]:
    """The fields of SHAPES[shape], or of SHAPES[NAME] with num_hidden_layers=L for NAME@L."""
    if not is_shape(shape):
        raise ValueError(f"--shape {shape!r}: known shapes are {sorted(SHAPES)}, or NAME@LAYERS")
    base, _, layers = shape.partition("@")
    return {**SHAPES[base], **({"num_hidden_layers": int(layers)} if layers else {})}


def hf_config(shape: str) -> dict[str, Any]:
    spec = shape_spec(shape)
    model_type = spec["model_type"]
    return {
        **spec,
        **(MOE_FIELDS if model_type == "qwen3_moe" else {}),
        "architectures": [ARCHITECTURES[model_type]],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }


def hf_tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name of the checkpoint and its shape."""
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        shapes.update(
            {a + "q_proj.weight": (n * d, h), a + "k_proj.weight": (g * d, h), a + "v_proj.weight": (g * d, h)}
        )
        if cfg["model_type"] == "qwen2":
            shapes.update({a + "q_proj.bias": (n * d,), a + "k_proj.bias": (g * d,), a + "v_proj.bias": (g * d,)})
        if cfg["model_type"] in ("qwen3", "qwen3_moe"):
            shapes.update({a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        shapes[a + "o_proj.weight"] = (h, n * d)
        if is_moe(cfg):
            fe = cfg["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                x = f"{p}mlp.experts.{e}."
                shapes.update(
                    {x + "gate_proj.weight": (fe, h), x + "up_proj.weight": (fe, h), x + "down_proj.weight": (h, fe)}
                )
        else:
            shapes.update(
                {
                    p + "mlp.gate_proj.weight": (f, h),
                    p + "mlp.up_proj.weight": (f, h),
                    p + "mlp.down_proj.weight": (h, f),
                }
            )
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def parameter_counts(cfg: dict[str, Any]) -> dict[str, int]:
    """Total parameters and the matmul parameters N of the FLOP count; an MoE shape adds "active",
    the N its FLOPs count (module docstring)."""
    shapes = hf_tensor_shapes(cfg)
    total = sum(_numel(s) for s in shapes.values())
    embedding = _numel(shapes["model.embed_tokens.weight"])
    matmul = total if cfg["tie_word_embeddings"] else total - embedding
    counts = {"total": total, "matmul": matmul, "embedding": embedding}
    if is_moe(cfg):
        expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"]
        idle = cfg["num_hidden_layers"] * (cfg["num_experts"] - cfg["num_experts_per_tok"]) * expert
        counts["active"] = matmul - idle
    return counts


def mfu_basis(cfg: dict[str, Any]) -> str:
    """Which N a shape's MFU counts: "active" (an MoE shape) or "matmul" (module docstring)."""
    return "active" if is_moe(cfg) else "matmul"


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for x in shape:
        out *= x
    return out


def step_flops(
    cfg: dict[str, Any], lengths: list[int], passes: int = 3, head_tokens: int | None = None
) -> dict[str, float]:
    """``passes=3`` for forward + backward, 1 for a forward; ``head_tokens``: count the LM head on
    that many tokens instead of all of them (module docstring); an MoE shape's N is its active count."""
    counts = parameter_counts(cfg)
    n = counts.get("active", counts["matmul"])
    d_attn = cfg["num_attention_heads"] * cfg["head_dim"]
    dense = 2.0 * passes * n * sum(lengths)
    if head_tokens is not None:
        head = cfg["vocab_size"] * cfg["hidden_size"]
        dense += 2.0 * passes * head * (head_tokens - sum(lengths))
    attention = 2.0 * passes * cfg["num_hidden_layers"] * d_attn * sum(s * s for s in lengths)
    return {"dense": dense, "attention": attention}


def mfu(flops: float, seconds: float) -> float:
    return flops / seconds / PEAK_BF16_FLOPS if seconds > 0 else 0.0


def write_random_checkpoint(
    path: Path,
    shape: str,
    seed: int,
    device: str,
    config_changes: dict[str, Any] | None = None,
    extra_files: Callable[[Path], Any] | None = None,
) -> Path:
    """An HF checkpoint folder (config.json + model.safetensors, bf16) with N(0, 0.02) weights and
    unit norms, reproducible from ``seed``; written once and renamed into place (atomic).
    ``config_changes``: fields of config.json that differ from ``hf_config`` (not the shape's);
    ``extra_files(folder)`` writes more files (a tokenizer) before the rename."""
    if (path / "model.safetensors").is_file():
        return path
    cfg = {**hf_config(shape), **(config_changes or {})}
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, dims in hf_tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(dims, dtype=torch.bfloat16)
        else:
            t = (torch.randn(dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()
        tensors[name] = t
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=1))
    if extra_files is not None:
        extra_files(tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process won the race; its folder is the same checkpoint
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def shared_checkpoint(root: Path, shape: str, seed: int, device: str, local_rank: int, timeout_s: float = 900) -> Path:
    """Local rank 0 writes the checkpoint; the other ranks of the machine wait for it."""
    path = root / f"{shape}-seed{seed}"
    if local_rank == 0:
        return write_random_checkpoint(path, shape, seed, device)
    deadline = time.monotonic() + timeout_s
    while not (path / "model.safetensors").is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path}: checkpoint not written by local rank 0 within {timeout_s} s")
        time.sleep(0.5)
    return path


def pairs_of_samples(samples: int) -> dict[str, int]:
    """A trainer-only step of `samples` samples as prompt groups of two: GRPO refuses groups of one
    (every advantage 0), and the benchmark's batch brings its own advantages anyway."""
    if samples % 2:
        raise ValueError(f"a trainer benchmark's step has an even number of samples (got {samples})")
    return {"rollout_batch_size": samples // 2, "n_samples_per_prompt": 2}


def build_trainer(shape: str, device: str, tp: int, seed: int, checkpoint_root: Path, **cfg_fields: Any) -> Any:
    """A ``MegatronTrainer`` (initialised: process group, model, HF load, DDP, optimizer) for this
    process, over a random checkpoint of ``shape``; rank and world from torchrun's variables."""
    # boundary: build_model.py and rollout_vs_offline.py import this module without megatron
    from vime_core.trainer.parallel import free_port
    from vime_core.trainer.trainer import MegatronTrainer

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    ckpt = shared_checkpoint(checkpoint_root, shape, seed, device, local_rank)
    fields: dict[str, Any] = dict(
        hf_checkpoint=str(ckpt),
        device=device,
        bf16=device == "cuda",
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=world,
        colocate=False,
        rollout_num_gpus=1,
        num_steps_per_rollout=1,
        clip_grad=1.0,
        seed=seed,
        storage_uri="/tmp/vime_bench_runs",
    )
    fields.update(cfg_fields)
    fields.update(pairs_of_samples(fields.pop("rollout_batch_size", 8)))
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", 0)) or free_port()
    # the demo's optimizer settings (lr, micro-batch, entropy bonus) that these benchmarks measured with
    trainer = MegatronTrainer(demo_config(**fields), rank, world, addr, port)
    trainer.init()
    return trainer


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    """Seconds of ``fn()`` with the device synchronised on both ends, and its result."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def device_memory(device: str) -> dict[str, float]:
    """Allocated / reserved / peak (GiB) and the driver's free and total memory."""
    if device != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info()
    gib = 2.0**30
    return {
        "allocated_gib": torch.cuda.memory_allocated() / gib,
        "reserved_gib": torch.cuda.memory_reserved() / gib,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib,
        "driver_used_gib": (total - free) / gib,
    }


def write_json(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=1, sort_keys=False)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def summary_lines(path: str) -> list[str]:
    """One line per variant / shape of a result file (for the end of a device run's output)."""
    r = json.loads(Path(path).read_text())
    lines = [f"== {Path(path).name}: {r.get('bench')} {r.get('shape', '')} {r.get('layout', '')}"]
    for v in r.get("variants", []):
        if "error" in v:
            lines.append(f"  {v['variant']:<28} ERROR {v['error'][:300]}")
            continue
        lines.append(
            f"  {v['variant']:<28} step {v['step_time_s'] * 1e3:8.1f} ms  {v['tokens_per_s']:9.0f} tok/s  "
            f"mfu {v['mfu_6N'] * 100:5.1f}% (+attn {v['mfu_with_attention'] * 100:5.1f}%)  "
            f"x{v.get('speedup_vs_baseline', 0):.2f}  "
            f"logprob {v['logprob_tokens_per_s']:9.0f} tok/s"
            + (
                f" mfu(+attn) {v['logprob_mfu_with_attention'] * 100:5.1f}%"
                if "logprob_mfu_with_attention" in v
                else ""
            )
            + f"  peak {v['peak_memory_gib_per_rank']} GiB"
        )
    for s in r.get("shapes", []):
        lines.append(
            f"  {s['shape']}: {s['bytes'] / 1e9:.2f} GB in {s['buckets']} buckets; median s {s['median_s']}; "
            f"receive {s['receive_GBps']:.0f} GB/s vs d2d {s['d2d_GBps']:.0f} GB/s; "
            f"e2e {s['end_to_end_GBps']:.0f} GB/s; "
            f"mismatched {s['checksums_mismatched']}"
        )
        sw = s.get("sleep_wake", {})
        for c in sw.get("cycles", []):
            before, asleep = c["memory_before_gib"], c["memory_asleep_gib"]
            lines.append(
                f"    sleep {c['sleep_s']:.2f} s frees {c['freed_gib']:.2f} GiB "
                f"(allocated {before.get('allocated_gib', 0):.2f} -> {asleep.get('allocated_gib', 0):.2f} GiB, "
                f"driver {before.get('driver_used_gib', 0):.2f} -> {asleep.get('driver_used_gib', 0):.2f} GiB); "
                f"wake {c['wake_s']:.3f} s"
            )
        lines.append(f"    { ({k: v for k, v in sw.items() if k != 'cycles'}) }")
    return lines


if __name__ == "__main__":
    import sys

    for p in sys.argv[1:]:
        try:
            print("\n".join(summary_lines(p)))
        except Exception as err:  # a missing or partial file: say so and go on
            print(f"== {p}: {type(err).__name__}: {err}")
