"""What vime adds to the colocated step, measured on the same GPU right after a colocated run while its
engine is still up: a direct rollout to its vLLM server, the trainer alone on a batch of the same
shape, and a device-to-device copy of the published bytes.

    framework_ratio   = T_step / (direct rollout s + trainer alone s)
    rollout_tps_ratio = vime output tokens/s / direct output tokens/s
    publish_vs_copy   = publish s / D2D copy s

    python bench/gpu/colocated_baselines.py --ray-address A --storage-uri S --run-name R --from-rollout 8 \
        --out baselines.json
    # without a GPU, for other iterations, from an earlier output: add --to-rollout 6 --measured baselines.json"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench" / "gpu"))
import ray  # noqa: E402
import torch  # noqa: E402
from rollout_vs_offline import through_server  # noqa: E402
from vime_core.cluster import names  # noqa: E402
from vime_core.config.loader import read_run_config  # noqa: E402
from vime_core.report.records import read_records  # noqa: E402
from vime_core.rollout.generate import base_sampling_params, request_params  # noqa: E402
from vime_core.storage.store import BatchStore  # noqa: E402


def _median(values):
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


async def direct_rollout(url: str, prompts: list[list[int]], cfg, concurrency: int, token=None) -> dict:
    """Every prompt once, straight to the server; the same budget rule as rollout/generate."""
    params = request_params(base_sampling_params(cfg), cfg.rollout_max_response_len)
    return await through_server(url, prompts, params, concurrency, cfg.rollout_max_context_len, token)


def device_copy_s(nbytes: int, repeats: int = 20) -> float:
    """Median seconds of one device-to-device copy of `nbytes` on the current GPU."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[2:])


def trainer_alone(
    samples: int,
    prompt_len: int,
    response_len: int,
    cfg,
    out: Path,
    extra_variants: tuple[str, ...] = (),
    model_shape: str = "0.5b",
) -> dict:
    """bench_trainer_gpu on a batch of this shape: the run's own packing first (the variant the
    figures below are of), then `extra_variants` measured in the same process for comparison."""
    variants = ",".join((f"pack{cfg.max_tokens_per_gpu}", *extra_variants))
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_trainer_gpu.py"),
        "--shape",
        model_shape,
        "--samples",
        str(samples),
        "--prompt-len",
        str(prompt_len),
        "--response-len",
        str(response_len),
        "--lr",
        str(cfg.lr),
        "--variants",
        variants,
        "--warmup",
        "1",
        "--repeats",
        "3",
        "--check-steps",
        "0",
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=REPO)
    result = json.loads(out.read_text())
    variant = next(v for v in result["variants"] if "step_time_s" in v)
    return {
        "step_time_s": variant["step_time_s"],
        "logprob_time_s": variant["logprob_time_s"],
        "total_s": variant["step_time_s"] + variant["logprob_time_s"],
        "command": " ".join(cmd[1:]),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray-address", help="the run's Ray head (not needed with --measured)")
    p.add_argument("--storage-uri", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--from-rollout", type=int, default=1, help="the run's iterations compared: rollout ids >= this")
    p.add_argument("--to-rollout", type=int, default=None, help="and rollout ids <= this")
    p.add_argument("--measured", default=None, help="take the baselines from this earlier output instead of measuring")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    records = [
        r
        for r in read_records(a.storage_uri, a.run_name)
        if a.from_rollout <= r["rollout_id"] <= (a.to_rollout if a.to_rollout is not None else r["rollout_id"])
    ]

    vime = {
        "t_step_median_s": _median([r["t_step"] for r in records]),
        "phases_median_s": {k: _median([r.get(k) for r in records]) for k in sorted(records[0]) if k.startswith("t_")},
        "rollout_tokens_per_s": _median([r["output_tokens"] / r["t_rollout"] for r in records if r.get("t_rollout")]),
        # the rollout loop's own count over its generation time (excludes reward and batch build)
        "generation_tokens_per_s": _median([r.get("generate_tokens_per_s") for r in records]),
        "publish_median_s": _median([r.get("publish_s") for r in records]),
    }
    phases = vime["phases_median_s"]
    vime["sleep_wake_median_s"] = {
        "engine_sleep": phases.get("t_offload_rollout"),
        "trainer_sleep": phases.get("t_offload_train"),
        "engine_wake_weights_and_kv": phases.get("t_onload"),
        "trainer_wake": phases.get("t_wake_train"),
    }
    result = {
        "bench": "colocated_baselines",
        "run": a.run_name,
        "rollout_ids": [r["rollout_id"] for r in records],
        "vime": vime,
    }
    if a.measured:
        measured = json.loads(Path(a.measured).read_text())
        result.update(
            {k: measured[k] for k in ("shape", "direct_rollout", "device_copy", "trainer_alone")},
            measured_in=a.measured,
        )
        straight, limit, alone = (measured[k] for k in ("direct_rollout", "device_copy", "trainer_alone"))
        return _write_ratios(result, vime, straight, limit, alone, a.out)

    cfg = read_run_config(a.storage_uri, a.run_name)
    batch, _ = BatchStore(a.storage_uri).read(a.run_name, max(r["rollout_id"] for r in records))
    prompts = [list(t[:pl]) for t, pl in zip(batch["tokens"], batch["prompt_length"])]
    mean_prompt = round(statistics.fmean(batch["prompt_length"]))
    mean_response = round(statistics.fmean(batch["response_length"]))
    result["shape"] = {"samples": len(prompts), "mean_prompt_len": mean_prompt, "mean_response_len": mean_response}

    def section(name: str, measure) -> dict | None:
        """One baseline; a failure is recorded (and the others still run) instead of losing all."""
        try:
            result[name] = measure()
        except Exception as exc:  # noqa: BLE001 - a benchmark keeps what it measured
            result[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        return None if "error" in result[name] else result[name]

    def direct() -> dict:
        ray.init(address=a.ray_address, namespace=names.namespace(a.run_name), logging_level="ERROR")
        engine = ray.get_actor(names.engine(0), namespace=names.namespace(a.run_name))
        url, token = ray.get([engine.get_url.remote(), engine.engine_token.remote()])
        runs = [
            asyncio.run(direct_rollout(url, prompts, cfg, cfg.vllm_server_concurrency, token)) for _ in range(a.repeats)
        ]
        return {
            "runs": runs,
            "wall_median_s": _median([d["wall_s"] for d in runs]),
            "tokens_per_s_median": _median([d["tokens_per_s"] for d in runs]),
        }

    def copy() -> dict:
        weight_bytes = sum(f.stat().st_size for f in Path(cfg.hf_checkpoint).glob("*.safetensors"))
        median_s = device_copy_s(weight_bytes)
        return {"bytes": weight_bytes, "median_s": median_s, "gb_per_s": weight_bytes / median_s / 1e9}

    straight = section("direct_rollout", direct)
    limit = section("device_copy", copy)
    alone = section(
        "trainer_alone",
        lambda: trainer_alone(
            len(prompts), mean_prompt, mean_response, cfg, Path(a.out).with_name("trainer_alone.json")
        ),
    )
    return _write_ratios(result, vime, straight, limit, alone, a.out)


def _write_ratios(
    result: dict, vime: dict, straight: dict | None, limit: dict | None, alone: dict | None, out: str
) -> int:
    """The ratios of the module docstring (None where a baseline failed), written with the rest."""
    ok = lambda part: part if part and "error" not in part else None  # noqa: E731
    straight, limit, alone = ok(straight), ok(limit), ok(alone)
    result["framework_ratio"] = (
        vime["t_step_median_s"] / (straight["wall_median_s"] + alone["total_s"]) if straight and alone else None
    )
    result["rollout_tps_ratio"] = vime["rollout_tokens_per_s"] / straight["tokens_per_s_median"] if straight else None
    result["publish_vs_copy"] = (
        vime["publish_median_s"] / limit["median_s"] if limit and vime["publish_median_s"] else None
    )
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("framework_ratio", "rollout_tps_ratio", "publish_vs_copy")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
