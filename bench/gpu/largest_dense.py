"""The largest dense shape that trains with full fine-tuning colocated on one GPU (issue 43), found by
runs, not by arithmetic: the layers of a base shape (default 8b, Qwen3-8B's layer: 8.19e9 parameters
at 36 layers) searched by bisection with the trainer alone, then the largest that fits confirmed by
`vime train` colocated.

Trainer-alone search. Candidate NAME@L (gpu_common.shape_spec) fits when bench/bench_trainer_gpu.py
runs the colocated run's optimizer step on its batch (32x8 samples of 512 + 1020 tokens, micro-batches
of 8192 tokens, the distributed optimizer: bench/gpu/colocated_4b.yaml's settings) with its memory
capped at the device's less what a sleeping engine keeps on it (--engine-asleep-gib; default: the
most any colocated run recorded, `engines_after_offload_rollout` in bench/results/colocated.jsonl).
The search assumes that a shape fitting means every smaller one fits (memory grows with L).

Confirmation. The largest fitting L runs colocated (bench/gpu/run_colocated_h200.sh, --iterations,
colocated_4b.yaml); a failed run tries L - 1, up to --confirm-tries runs.

    python3 bench/gpu/largest_dense.py --base 8b --layers 14,36 --out largest.json
    bench/run.py largest_dense --base 8b --layers 14,36
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
import gpu_common  # noqa: E402

CONFIG = REPO / "bench" / "gpu" / "colocated_4b.yaml"
COLOCATED_ROWS = REPO / "bench" / "results" / "colocated.jsonl"


def largest_fitting(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest L in [lo, hi] with fits(L), fits monotone (true up to some L, false after);
    None when lo does not fit. Tries hi first (a range that all fits costs one probe), then lo,
    then halves the range between the largest known fit and the smallest known failure."""
    if fits(hi):
        return hi
    if hi == lo or not fits(lo):
        return None
    good, bad = lo, hi
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def engine_asleep_gib(rows_path: Path = COLOCATED_ROWS) -> float:
    """The most device memory a sleeping engine held in any recorded colocated run (GiB)."""
    held = [
        entry["engines_after_offload_rollout"]["device_used_gib"]
        for line in rows_path.read_text().splitlines()
        if line.strip()
        for entry in json.loads(line)["figures"].get("memory", [])
        if "engines_after_offload_rollout" in entry
    ]
    if not held:
        raise SystemExit(f"{rows_path}: no colocated run recorded a sleeping engine's memory; pass --engine-asleep-gib")
    return max(held)


def probe_command(a: argparse.Namespace, shape: str, out: Path, limit_gib: float | None) -> list[str]:
    cmd = [sys.executable, str(REPO / "bench" / "bench_trainer_gpu.py"), "--shape", shape, "--device", a.device]
    cmd += ["--samples", str(a.samples), "--prompt-len", str(a.prompt_len), "--response-len", str(a.response_len)]
    cmd += ["--variants", a.variant, "--warmup", "0", "--repeats", "1", "--check-steps", "0"]
    cmd += ["--path-check-samples", "0", "--checkpoint-root", str(a.work / "ckpt"), "--out", str(out)]
    if a.device == "cuda":  # Megatron's distributed optimizer needs CUDA
        cmd.append("--distributed-optimizer")
    if limit_gib is not None:
        cmd += ["--memory-limit-gib", f"{limit_gib:.3f}"]
    return cmd


def probe(a: argparse.Namespace, layers: int, limit_gib: float | None) -> dict:
    """One trainer-alone step of BASE@layers; its random checkpoint is removed afterwards (disk)."""
    shape = f"{a.base}@{layers}"
    out = a.work / f"probe-{layers}.json"
    t0 = time.monotonic()
    try:
        rc = subprocess.run(probe_command(a, shape, out, limit_gib), timeout=a.probe_timeout).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    shutil.rmtree(a.work / "ckpt", ignore_errors=True)
    result = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
    variant = (result.get("variants") or [{}])[0]
    return {
        "shape": shape,
        "layers": layers,
        "params": gpu_common.parameter_counts(gpu_common.hf_config(shape))["total"],
        "exit": rc,
        "fits": rc == 0 and bool(variant),
        "peak_reserved_gib": max(variant.get("peak_reserved_gib_per_rank") or [0.0]) or None,
        "step_time_s": variant.get("step_time_s"),
        "seconds": time.monotonic() - t0,
    }


def confirm(a: argparse.Namespace, layers: int) -> dict:
    """`vime train` colocated on BASE@layers (run_colocated_h200.sh): its exit and report."""
    shape = f"{a.base}@{layers}"
    out = a.work / f"colocated-{layers}"
    # a run name per candidate: a RUN_NAME from outside would make the next try resume this one's run
    env = dict(
        os.environ,
        SHAPE=shape,
        CONFIG=str(CONFIG),
        PROMPT_TOKENS=str(a.prompt_len),
        OUT=str(out),
        RUN_NAME=f"largest-{a.base}-{layers}",
    )
    t0 = time.monotonic()
    rc = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu" / "run_colocated_h200.sh"), str(a.iterations)], env=env
    ).returncode
    report = out / f"colocated_{shape}.json"
    figures = json.loads(report.read_text()) if report.exists() else {}
    shutil.rmtree(Path(os.environ.get("VIME_GPU_WORK", "/tmp/vime-gpu")) / f"model-{shape}", ignore_errors=True)
    return {
        "shape": shape,
        "exit": rc,
        "iterations": figures.get("iterations", 0),
        "t_step_median_s": (figures.get("phases_median_s") or {}).get("t_step"),
        "memory": figures.get("memory", []),
        "seconds": time.monotonic() - t0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="8b", help="the shape whose layers are searched (gpu_common.SHAPES)")
    p.add_argument("--layers", default="14,36", help="LO,HI: the range of layers searched")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--engine-asleep-gib", type=float, default=None, help="default: bench/results' largest record")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=1020)
    p.add_argument("--variant", default="pack8192+fused", help="bench_trainer_gpu.py's batching of the step")
    p.add_argument("--probe-timeout", type=float, default=600)
    p.add_argument("--iterations", type=int, default=2, help="of the colocated confirmation (0: none)")
    p.add_argument("--confirm-tries", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("/tmp/vime-largest"))
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    lo, hi = (int(x) for x in a.layers.split(","))
    if not (gpu_common.is_shape(a.base) and 0 < lo <= hi):
        raise SystemExit(f"--base {a.base!r} --layers {a.layers!r}: a shape of gpu_common.SHAPES and 0 < LO <= HI")
    a.work.mkdir(parents=True, exist_ok=True)
    limit = total = asleep = None
    if a.device == "cuda":
        import torch  # boundary: the GPU host's trainer site

        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        asleep = a.engine_asleep_gib if a.engine_asleep_gib is not None else engine_asleep_gib()
        limit = total - asleep
    probes: dict[int, dict] = {}

    def fits(layers: int) -> bool:
        probes[layers] = probe(a, layers, limit)
        print(f"[largest] {json.dumps(probes[layers])}", flush=True)
        return probes[layers]["fits"]

    largest = largest_fitting(lo, hi, fits)
    confirmed, runs = None, []
    if largest is not None and a.iterations:
        for layers in range(largest, max(lo, largest - a.confirm_tries + 1) - 1, -1):
            runs.append(confirm(a, layers))
            print(f"[largest] colocated {layers} layers: exit {runs[-1]['exit']}", flush=True)
            if runs[-1]["exit"] == 0 and runs[-1]["iterations"]:
                confirmed = runs[-1]["shape"]
                break
    result = {
        "bench": "largest_dense",
        "base": a.base,
        "layers_searched": [lo, hi],
        "device_total_gib": total,
        "engine_asleep_gib": asleep,
        "trainer_limit_gib": limit,
        "settings": {
            "samples": a.samples,
            "prompt_len": a.prompt_len,
            "response_len": a.response_len,
            "variant": a.variant,
        },
        "probes": [probes[k] for k in sorted(probes)],
        "largest_trainer_alone": f"{a.base}@{largest}" if largest is not None else None,
        "colocated_runs": runs,
        "confirmed": confirmed,
        "confirmed_params": gpu_common.parameter_counts(gpu_common.hf_config(confirmed))["total"]
        if confirmed
        else None,
    }
    gpu_common.write_json(result, a.out)
    return 0 if largest is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
