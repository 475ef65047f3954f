"""Megatron trainer step and old-log-prob recompute on GPUs, one process per GPU (TP x DP under torchrun).

Runs vime's own trainer code on a synthetic batch for a Qwen-style model built from a config
(gpu_common.SHAPES, random bf16 weights). Each --variants entry runs in the same process, the first
being the baseline (speedup = baseline step time / variant step time); a variant is a batching
choice plus options joined with +:

    mbsN          fixed micro-batches of N samples per DP rank
    packT         micro-batches packed by a token budget T (use_dynamic_batch_size)
    +fused        torch's fused AdamW inside Megatron's optimizer (default: foreach AdamW)
    +recompute    full activation recompute of every layer
    +compile      with +fullhead: torch.compile of its loss head
    +eagerhead    the chunked response head's chunk math eagerly (logprobs.COMPILE_ON_CUDA off)
    +devseq       the packed segment offsets (cu_seqlens) on the device (packing.py keeps them on the host)
    +oldattn      per-segment SDPA with K/V repeated to the query heads (attention.py)
    +fullhead     logits at every position and Megatron's cross-entropy (logprobs.packed_response_log_probs_full)
    +unfusedrope  Megatron's unfused RoPE instead of vime's packed one (rope.py)
    +unfusedswiglu  SwiGLU unfused instead of Megatron's compiled one
    +seqexperts   MoE experts one MLP after another (SequentialMLP) instead of grouped GEMMs

Per variant: median step time, tokens/s, MFU (formulas in gpu_common), the recompute's time and
peak memory; path_check compares each variant's log-probs with the first's. For example:

    python bench/bench_trainer_gpu.py --shape 0.5b --variants mbs4,mbs16,mbs16+fused --out r.json
    torchrun --nproc_per_node 2 bench/bench_trainer_gpu.py --shape 0.5b --tp 2 --out tp2.json
    python bench/bench_trainer_gpu.py --compare tp1.json tp2.json"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import gpu_common as common  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from vime_core.data.schedule import build_dp_schedule  # noqa: E402
from vime_core.trainer import logprobs, rope, train_step  # noqa: E402
from vime_core.trainer import model as model_module  # noqa: E402
from vime_core.trainer.attention import SDPACoreAttention  # noqa: E402
from vime_core.trainer.grouped_experts import GroupedMLP  # noqa: E402
from vime_core.trainer.hf_convert import unwrap  # noqa: E402
from vime_core.trainer.model import fusion_settings  # noqa: E402
from vime_core.trainer.packing import PackedMicroBatch  # noqa: E402
from vime_core.trainer.parallel import destroy_parallel  # noqa: E402
from vime_core.trainer.rollout_training import step_advantages, train_on_rollout  # noqa: E402

CHECK_TOKENS = 2048  # initial log-probs kept in the JSON for layout comparisons


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # ---- model and layout
    p.add_argument("--shape", default="0.5b", help=f"model shape: {', '.join(common.SHAPES)}, or NAME@LAYERS")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (DP = world size / tp)")
    p.add_argument("--checkpoint-root", default="/tmp/vime_bench_ckpt", help="where random HF checkpoints are written")
    p.add_argument("--seed", type=int, default=1234)
    # ---- batch
    p.add_argument("--samples", type=int, default=16, help="samples per rollout = per optimizer step (all DP ranks)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (the maximum with --vary)")
    p.add_argument("--response-len", type=int, default=256, help="response tokens (the maximum with --vary)")
    p.add_argument("--vary", action="store_true", help="draw lengths uniformly from [min, max] instead of fixed")
    p.add_argument("--prompt-min-len", type=int, default=16, help="smallest prompt with --vary")
    p.add_argument("--response-min-len", type=int, default=16, help="smallest response with --vary")
    p.add_argument(
        "--path-check-samples",
        type=int,
        default=32,
        help="samples whose initial log-probs each variant compares with the first's (0: none)",
    )
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--distributed-optimizer", action="store_true", help="Megatron's distributed optimizer (the 4b runs' setting)"
    )
    p.add_argument(
        "--memory-limit-gib",
        type=float,
        default=None,
        help="the device memory this process may use (torch's per-process fraction): what a colocated trainer "
        "has beside its sleeping engine; beyond it, a CUDA OOM",
    )
    # ---- what to measure
    p.add_argument(
        "--variants", default="mbs4", help="comma-separated variants (module docstring); the first is the baseline"
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-steps", type=int, default=3, help="training steps recorded in 'check' (0: none)")
    p.add_argument("--out", default=None, help="JSON result file (rank 0)")
    p.add_argument(
        "--norms-fp32",
        action="store_true",
        help="keep the RMSNorm weights in fp32 as Megatron's torch fallback makes them (before model.norms_in_dtype)",
    )
    p.add_argument(
        "--profile", default=None, help="after the variants, profile one step of the first variant into this text file"
    )
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare the 'check' sections of two result files")
    return p.parse_args(argv)


# ---- synthetic rollout batch ---------------------------------------------------------------------


def synthetic_batch(args: argparse.Namespace, vocab: int) -> dict[str, list]:
    """Random token ids and advantages; the same on every rank (seeded)."""
    rng = random.Random(args.seed)
    batch: dict[str, list] = {
        k: [] for k in ("tokens", "response_length", "total_length", "loss_mask", "advantage", "reward")
    }
    for _ in range(args.samples):
        prompt = rng.randint(args.prompt_min_len, args.prompt_len) if args.vary else args.prompt_len
        response = rng.randint(args.response_min_len, args.response_len) if args.vary else args.response_len
        adv = rng.gauss(0.0, 1.0)
        batch["tokens"].append([rng.randrange(vocab) for _ in range(prompt + response)])
        batch["response_length"].append(response)
        batch["total_length"].append(prompt + response)
        batch["loss_mask"].append([1] * response)
        batch["advantage"].append(adv)
        batch["reward"].append(adv)
    return batch


# ---- variants ----------------------------------------------------------------------------------------


class Options:
    """Switches the bench options on the live trainer and back off (so variants share one model)."""

    def __init__(self, trainer: Any, base_cfg: Any) -> None:
        self.trainer, self.base_cfg = trainer, base_cfg
        self.logprobs, self.train_step = logprobs, train_step
        self.loss_head = logprobs.log_probs_and_entropy
        self.compiled_loss_head: Any = None
        self.head = train_step.packed_response_log_probs
        self.packed_attention = SDPACoreAttention._packed
        self.packed_seq_params = PackedMicroBatch.packed_seq_params

    def apply(self, spec: str) -> None:
        batching, *flags = spec.split("+")
        unknown = set(flags) - {
            "fused",
            "recompute",
            "compile",
            "devseq",
            "oldattn",
            "fullhead",
            "eagerhead",
            "unfusedrope",
            "unfusedswiglu",
            "seqexperts",
        }
        if unknown:
            raise ValueError(f"variant {spec!r}: unknown option(s) {sorted(unknown)}")
        if batching.startswith("mbs"):
            update = dict(micro_batch_size=int(batching[3:]), use_dynamic_batch_size=False, max_tokens_per_gpu=None)
        elif batching.startswith("pack"):
            update = dict(use_dynamic_batch_size=True, max_tokens_per_gpu=int(batching[4:]))
        else:
            raise ValueError(f"variant {spec!r}: batching must be mbsN or packT")
        self.trainer.cfg = self.base_cfg.model_copy(update=update)
        self.set_fused_adam("fused" in flags)
        self.set_recompute("recompute" in flags)
        if "compile" in flags and "fullhead" not in flags:
            raise ValueError(f"variant {spec!r}: +compile applies to +fullhead (the chunked head is compiled on CUDA)")
        self.set_old_attention("oldattn" in flags)
        self.set_full_head("fullhead" in flags)
        self.set_compiled_loss_head("compile" in flags)
        self.logprobs.COMPILE_ON_CUDA = "eagerhead" not in flags
        self.set_device_offsets("devseq" in flags)
        self.set_fusions(rope_fusion="unfusedrope" not in flags, swiglu_fusion="unfusedswiglu" not in flags)
        self.set_grouped_experts("seqexperts" not in flags)

    def set_grouped_experts(self, on: bool) -> None:
        """MoE experts as grouped GEMMs (the run's moe_grouped_gemm where the host has the kernel) or in turn."""
        for module in self.trainer.model.modules():
            if isinstance(module, GroupedMLP):
                module.use_grouped = on

    def set_fusions(self, rope_fusion: bool, swiglu_fusion: bool) -> None:
        """The run's fusions (model.fusion_settings: on CUDA unless switched off) less the variant's."""
        base = fusion_settings(self.base_cfg, self.trainer.device)
        config = unwrap(self.trainer.model).config
        config.apply_rope_fusion = base["apply_rope_fusion"] and rope_fusion
        config.bias_activation_fusion = base["bias_activation_fusion"] and swiglu_fusion
        if config.apply_rope_fusion:
            rope.install()

    def set_old_attention(self, on: bool) -> None:
        SDPACoreAttention._packed = SDPACoreAttention._packed_per_segment if on else self.packed_attention  # type: ignore[method-assign]

    def set_full_head(self, on: bool) -> None:
        # train_step imported the head by name: forward_log_probs and micro_batch_loss read it there
        self.train_step.packed_response_log_probs = self.logprobs.packed_response_log_probs_full if on else self.head

    def set_device_offsets(self, on: bool) -> None:
        def on_device(mb: PackedMicroBatch) -> Any:
            params = self.packed_seq_params(mb)
            params.cu_seqlens_q = params.cu_seqlens_kv = mb.cu_seqlens.to(mb.input_ids.device)
            return params

        PackedMicroBatch.packed_seq_params = on_device if on else self.packed_seq_params  # type: ignore[method-assign]

    def set_fused_adam(self, on: bool) -> None:
        inner = self.trainer.optimizer.optimizer  # torch AdamW inside Megatron's mixed-precision wrapper
        for group in inner.param_groups:
            group["fused"] = on or None
            group["foreach"] = None if on else group.get("foreach")
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if step is not None:  # fused keeps the step counter on the device, the others on the CPU
                    inner.state[p]["step"] = step.to(p.device if on else "cpu", torch.float32)

    def set_recompute(self, on: bool) -> None:
        config = unwrap(self.trainer.model).config
        if on and self.trainer.device.type != "cuda":
            raise ValueError("+recompute needs CUDA (Megatron's checkpoint saves the CUDA RNG state)")
        config.recompute_granularity = "full" if on else None
        config.recompute_method = "uniform" if on else None
        config.recompute_num_layers = 1 if on else None

    def set_compiled_loss_head(self, on: bool) -> None:
        if on and self.compiled_loss_head is None:
            self.compiled_loss_head = torch.compile(self.loss_head, dynamic=True)
        self.logprobs.log_probs_and_entropy = self.compiled_loss_head if on else self.loss_head


# ---- one rollout's training, phase by phase (the steps of rollout_training.train_on_rollout) ----------


def schedule_for(trainer: Any, batch: dict[str, list], global_batch_size: int | None = None) -> list[list[list[int]]]:
    cfg, lay = trainer.cfg, trainer.layout
    budget = cfg.max_tokens_per_gpu if cfg.use_dynamic_batch_size else None
    lengths = [len(t) for t in batch["tokens"]]
    sched = build_dp_schedule(
        lengths, global_batch_size or cfg.global_batch_size, lay.dp_size, cfg.micro_batch_size, budget
    )
    return sched.micro_batches[lay.dp_rank]


def recompute_old(trainer: Any, batch: dict[str, list], mine: list[list[list[int]]]) -> dict[int, torch.Tensor]:
    flat = [mb for step in mine for mb in step]
    return train_step.forward_log_probs(
        trainer.model, batch, flat, trainer.arch.vocab_size, trainer.cfg.rollout_temperature, trainer.device
    )


def one_step(
    trainer: Any, batch: dict[str, list], mine: list[list[list[int]]], old: dict[int, torch.Tensor]
) -> dict[str, float]:
    cfg, lay = trainer.cfg, trainer.layout
    micro_batches = mine[0]
    step_indices = list(range(cfg.global_batch_size))
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=micro_batches,
        denominators=train_step.StepDenominators.of(batch, step_indices),
        advantages=step_advantages(cfg, batch, [i for mb in micro_batches for i in mb], old, None)[0],
        old_log_probs=old,
        step_tokens=sum(len(batch["tokens"][i]) for i in step_indices),
    )
    dp_group = parallel_state.get_data_parallel_group() if lay.dp_size > 1 else None
    return train_step.train_step(
        trainer.model, trainer.optimizer, inputs, cfg, trainer.arch.vocab_size, lay.dp_size, dp_group, trainer.device
    )


def measure_variant(
    trainer: Any, batch: dict[str, list], spec: str, opts: Options, args: argparse.Namespace, cfg_json: dict[str, Any]
) -> dict[str, Any]:
    dev = trainer.device.type
    opts.apply(spec)
    if dev == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    mine = schedule_for(trainer, batch)
    lengths = [len(t) for t in batch["tokens"]]
    # Warm-up through the actors' own entry point (schedule, old log-probs, advantages, step).
    # Then the timed phases once more, so that compilation (per graph) stays out of the numbers.
    for _ in range(args.warmup):
        train_on_rollout(trainer, batch)
        recompute_old(trainer, batch, mine)
    step_s, lp_s, losses, norms = [], [], [], []
    for _ in range(args.repeats):
        t_lp, old = common.timed(lambda: recompute_old(trainer, batch, mine), dev)
        t_step, metrics = common.timed(lambda: one_step(trainer, batch, mine, old), dev)
        lp_s.append(t_lp)
        step_s.append(t_step)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    step, lp = common.median(step_s), common.median(lp_s)
    world = trainer.layout.world_size
    responses = sum(int(r) for r in batch["response_length"])
    train_flops = common.step_flops(cfg_json, lengths, passes=3)
    fwd_flops = common.step_flops(cfg_json, lengths, passes=1)
    train_resp = common.step_flops(cfg_json, lengths, passes=3, head_tokens=responses)
    fwd_resp = common.step_flops(cfg_json, lengths, passes=1, head_tokens=responses)
    tokens = sum(lengths)
    return {
        "variant": spec,
        "micro_batches_per_step_per_rank": len(mine[0]),
        "step_time_s": step,
        "step_times_s": step_s,
        "tokens_per_s": tokens / step,
        "mfu_6N": common.mfu(train_flops["dense"], step) / world,
        "mfu_with_attention": common.mfu(train_flops["dense"] + train_flops["attention"], step) / world,
        "mfu_with_attention_response_head": common.mfu(train_resp["dense"] + train_resp["attention"], step) / world,
        "logprob_time_s": lp,
        "logprob_times_s": lp_s,
        "logprob_tokens_per_s": tokens / lp,
        "logprob_mfu_6N": common.mfu(fwd_flops["dense"], lp) / world,
        "logprob_mfu_with_attention": common.mfu(fwd_flops["dense"] + fwd_flops["attention"], lp) / world,
        "logprob_mfu_with_attention_response_head": common.mfu(fwd_resp["dense"] + fwd_resp["attention"], lp) / world,
        "peak_memory_gib_per_rank": gather_peak_memory(dev),
        "peak_reserved_gib_per_rank": gather_peak_memory(dev, reserved=True),
        "loss_last": losses[-1],
        "grad_norm_last": norms[-1],
    }


def gather_peak_memory(dev: str, reserved: bool = False) -> list[float]:
    """Each rank's peak of allocated (or, `reserved`, of its allocator's reserved) GiB."""
    if dev != "cuda":
        return []
    mine = (torch.cuda.max_memory_reserved() if reserved else torch.cuda.max_memory_allocated()) / 2.0**30
    out: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, mine)
    return [round(float(x), 3) for x in out]


def path_check(trainer: Any, batch: dict[str, list], specs: list[str], opts: Options, samples: int) -> dict[str, Any]:
    """Each variant's log-probs of the first ``samples`` samples against the first variant's, on the
    same (initial) weights: the old and new attention/head paths must agree to bf16 precision."""
    samples -= samples % trainer.layout.dp_size
    sub = {k: v[:samples] for k, v in batch.items()}
    out: dict[str, Any] = {"samples": samples}
    base = None
    for spec in specs:
        opts.apply(spec)
        mine = schedule_for(trainer, sub, global_batch_size=samples)
        lps = recompute_old(trainer, sub, mine)
        flat = torch.cat([lps[i].float() for i in sorted(lps)])
        if base is None:
            base = flat
            out["tokens"] = int(flat.numel())
            continue
        diff = (flat - base).abs()
        out[spec] = {
            "max_abs_diff": float(diff.max()),
            "mean_abs_diff": float(diff.mean()),
            "mean_log_prob": float(flat.mean()),
            "baseline_mean_log_prob": float(base.mean()),
        }
    return out


def layout_check(trainer: Any, batch: dict[str, list], args: argparse.Namespace) -> dict[str, Any]:
    """Numbers that must agree across layouts: initial log-probs, then a few steps' metrics."""
    mine = schedule_for(trainer, batch)
    old = recompute_old(trainer, batch, mine)
    # At DP > 1 each rank holds only its samples; gather them so rank 0 sees every sample.
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, {i: t.cpu() for i, t in old.items()})
    merged = {i: t for part in parts for i, t in part.items()}
    flat = torch.cat([merged[i] for i in sorted(merged)])
    steps = [train_on_rollout(trainer, batch) for _ in range(args.check_steps)]
    return {
        "initial_log_probs_head": [round(float(x), 5) for x in flat[:CHECK_TOKENS]],
        "initial_log_prob_mean": float(flat.mean()),
        "losses": [s["loss"] for s in steps],
        "grad_norms": [s["grad_norm"] for s in steps],
        "entropies": [s.get("entropy") for s in steps],
    }


def compare(a_path: str, b_path: str) -> dict[str, Any]:
    a, b = (json.loads(Path(p).read_text())["check"] for p in (a_path, b_path))
    la, lb = torch.tensor(a["initial_log_probs_head"]), torch.tensor(b["initial_log_probs_head"])
    rel = lambda x, y: [abs(p - q) / max(abs(p), 1e-12) for p, q in zip(x, y)]  # noqa: E731
    return {
        "a": a_path,
        "b": b_path,
        "initial_log_probs_max_abs_diff": float((la - lb).abs().max()),
        "initial_log_probs_mean_abs_diff": float((la - lb).abs().mean()),
        "loss_rel_diff": rel(a["losses"], b["losses"]),
        "grad_norm_rel_diff": rel(a["grad_norms"], b["grad_norms"]),
        "entropy_rel_diff": rel(a["entropies"], b["entropies"]),
    }


# ---- main ----------------------------------------------------------------------------------------------


def build_trainer(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    trainer = common.build_trainer(
        args.shape,
        args.device,
        args.tp,
        args.seed,
        Path(args.checkpoint_root),
        rollout_batch_size=args.samples,
        rollout_max_prompt_len=args.prompt_len,
        rollout_max_response_len=args.response_len,
        lr=args.lr,
        use_distributed_optimizer=args.distributed_optimizer,
    )
    return trainer, common.hf_config(args.shape)


def profile_step(trainer: Any, batch: dict[str, list], opts: Options, spec: str, path: str) -> None:
    """torch.profiler tables (by CPU time and by device time) of one old-log-prob pass + step."""
    opts.apply(spec)
    mine = schedule_for(trainer, batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    common.synchronize(trainer.device.type)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        old = recompute_old(trainer, batch, mine)
        one_step(trainer, batch, mine, old)
        common.synchronize(trainer.device.type)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort_device = "self_cuda_time_total" if trainer.device.type == "cuda" else "self_cpu_time_total"
    text = [
        f"variant {spec}: wall {wall * 1e3:.1f} ms (profiled)",
        events.table(sort_by="self_cpu_time_total", row_limit=45),
        events.table(sort_by=sort_device, row_limit=30),
    ]
    Path(path).write_text("\n\n".join(text))


def add_speedups(result: dict[str, Any]) -> None:
    """Each variant's ratio to the baseline (the first variant that ran)."""
    variants = result["variants"]
    base = next((v for v in variants if "step_time_s" in v), None)
    result["baseline"] = base["variant"] if base else None
    for v in variants:
        if base is not None and "step_time_s" in v:
            v["speedup_vs_baseline"] = base["step_time_s"] / v["step_time_s"]
            v["logprob_speedup_vs_baseline"] = base["logprob_time_s"] / v["logprob_time_s"]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.compare:
        common.write_json(compare(*args.compare), args.out)
        return
    warnings.filterwarnings("ignore")
    if args.norms_fp32:
        model_module.norms_in_dtype = lambda model, dtype: 0  # type: ignore[assignment]
    if args.memory_limit_gib is not None and args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        total = torch.cuda.get_device_properties(local).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_limit_gib * 2**30 / total), local)
    t0 = time.perf_counter()
    trainer, cfg_json = build_trainer(args)
    setup_s = time.perf_counter() - t0
    batch = synthetic_batch(args, cfg_json["vocab_size"])
    lengths = [len(t) for t in batch["tokens"]]
    lay = trainer.layout
    result: dict[str, Any] = {
        "bench": "trainer_gpu",
        "norms_fp32": args.norms_fp32,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "shape": args.shape,
        "params": common.parameter_counts(cfg_json),
        "layout": {"world_size": lay.world_size, "tp": lay.tp_size, "dp": lay.dp_size},
        "batch": {
            "samples": args.samples,
            "tokens_per_step": sum(lengths),
            "min_len": min(lengths),
            "max_len": max(lengths),
            "vary": args.vary,
        },
        "dtype": "bf16" if args.device == "cuda" else "fp32",
        "setup_s": setup_s,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "formula": {
            "mfu_6N": "6 * N_matmul * tokens / step_time / 989e12 / gpus",
            "mfu_with_attention": "(6 * N_matmul * tokens + sum_i 6 * layers * heads * head_dim * len_i^2) "
            "/ step_time / 989e12 / gpus   (causal: half of QK^T and PV)",
            "logprob_mfu_with_attention": "one third of the training FLOPs (forward only) / logprob_time / 989e12 "
            "/ gpus",
            "*_response_head": "the same with the LM head (vocab x hidden) counted on the response tokens only",
        },
        "argv": sys.argv[1:],
    }
    # One Options for the whole run: it keeps the unpatched functions that every variant restores.
    opts = Options(trainer, trainer.cfg)
    specs = [v for v in args.variants.split(",") if v]
    if args.check_steps:
        opts.apply(specs[0])
        result["check"] = layout_check(trainer, batch, args)
    if args.path_check_samples and len(specs) > 1:
        # before any variant trains: every path sees the same weights
        try:
            result["path_check"] = path_check(trainer, batch, specs, opts, min(args.path_check_samples, args.samples))
        except Exception as err:  # recorded; the timings still run
            result["path_check"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            if torch.distributed.get_world_size() > 1:
                raise
    variants: list[dict[str, Any]] = []
    result["variants"] = variants
    for spec in specs:
        try:
            variants.append(measure_variant(trainer, batch, spec, opts, args, cfg_json))
        except Exception as err:  # a failed option is a result too; the next variant still runs
            variants.append({"variant": spec, "error": f"{type(err).__name__}: {err}"[:2000]})
            if torch.distributed.get_world_size() > 1:
                raise  # ranks may be out of step: stop rather than hang
        print(f"[rank {lay.rank}] {variants[-1]}", file=sys.stderr, flush=True)
        add_speedups(result)
        if lay.rank == 0 and args.out:  # after every variant, so a run cut short keeps its results
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if lay.rank == 0:
        common.write_json(result, args.out)
        if args.out:
            print("\n".join(common.summary_lines(args.out)), file=sys.stderr, flush=True)
    if args.profile and lay.rank == 0 and lay.world_size == 1:
        profile_step(trainer, batch, opts, args.variants.split(",")[0], args.profile)
    destroy_parallel()


if __name__ == "__main__":
    main()
