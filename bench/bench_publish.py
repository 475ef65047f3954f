"""Benchmark of publish_weights into a real vLLM CPU engine, against two floors measured in the same
run on the same weights: a memcpy of the same bytes, and the engine reloading them from /dev/shm.

    publish  the whole publish_weights, transport shm, per bucket size
    disk     the disk fallback (write safetensors + reload), for reference
    gloo     gloo broadcast into a second engine with the vime_broadcast backend, against its reload

Models: build_tiny_model Qwen3 shapes, one engine at a time, in the trainer's precision (fp32;
--bf16). Prints JSON (medians over repeats; ratio = publish / reload; checksum_cost_ratio = the
first bucket size's publish with the transfer checksums / without them, in the same rounds).
Run: bench/run.py publish [--repeats N] [--transports shm gloo]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vime_core.config import make_config
from vime_core.demo.model import build_tiny_model
from vime_core.engines.client import SyncEngineClient
from vime_core.engines.server import EngineServer
from vime_core.weight_sync.publish import publish_weights
from vime_core.weight_sync.publish_loop import PublishLoop

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    # name: build_tiny_model shape
    "qwen3-104m": dict(
        hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=3072
    ),
    "qwen3-243m": dict(
        hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4, head_dim=64, intermediate_size=4096
    ),
}
MiB = 1024**2


def engine_settings(model_dir: Path, bf16: bool) -> dict:
    """The configuration of the bench's CPU engine (tests/unit/test_bench_configs.py checks it
    still validates when the defaults move)."""
    return {
        "hf_checkpoint": str(model_dir),
        "vllm_python": str(REPO / ".venv-vllm" / "bin" / "python"),
        "device": "cpu",
        "bf16": bf16,
        "rollout_max_context_len": 256,
        "rollout_max_prompt_len": 128,
        "vllm_cpu_kvcache_gb": 1,
    }


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def memcpy_seconds(weights: dict[str, torch.Tensor], dtype: torch.dtype, repeats: int) -> float:
    """(a) Copy every tensor, cast to the wire dtype, into one preallocated, already touched buffer."""
    total = sum(t.numel() for t in weights.values()) * dtype.itemsize
    dest = torch.zeros(total, dtype=torch.uint8)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        off = 0
        for t in weights.values():
            n = t.numel() * dtype.itemsize
            dest[off : off + n].view(dtype).view(t.shape).copy_(t)
            off += n
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def engine_rpc(url: str, token, method: str, *args, **kwargs):
    """One control call to the engine at `url` with the run's `token` (engines/auth.py)."""
    return getattr(SyncEngineClient(url, token=token), method)(*args, **kwargs)


def summarise(stats_list: list[dict], nbytes: int, reload_s: float, memcpy_s: float) -> dict:
    """Medians over repeats of one publish configuration, and its ratios to the floors."""
    total = median([s["seconds"]["total"] for s in stats_list])
    entry = {
        "seconds": total,
        "bytes_per_s": nbytes / total,
        "ratio_to_reload": total / reload_s,
        "ratio_to_memcpy": total / memcpy_s,
        "buckets": stats_list[0]["buckets"],
        "phases_s": {
            p: round(median([s["seconds"].get(p, 0.0) for s in stats_list]), 4) for p in stats_list[0]["seconds"]
        },
        # the group a broadcast forms on its first publish is not in the repeats (round 0 warms up)
        "transport_s": {
            p: round(median([s["transport_seconds"].get(p, 0.0) for s in stats_list]), 4)
            for p in stats_list[0]["transport_seconds"]
        },
    }
    if "engine" in stats_list[0]:
        entry["engine_s"] = {
            p: round(median([s["engine"][p] for s in stats_list]), 4)
            for p in ("map_seconds", "check_seconds", "load_seconds", "finish_seconds")
        }
    return entry


def bench_engine(base_cfg: dict, cfgs: dict, weights: dict, wire: torch.dtype, args) -> dict:
    """One engine started with `base_cfg`'s weight-transfer backend: each configuration of `cfgs`
    published `args.repeats` times (after a warm-up round), and the engine's own reload of the
    same weights from /dev/shm in every round. Returns the engine's start time, the reload
    floor and each configuration's summary (ratios against this engine's floor)."""
    server = EngineServer(make_config(base_cfg), 0, log_dir=str(REPO / ".cache" / "engine-logs"), warmup=False)
    t0 = time.perf_counter()
    server.start()
    out: dict = {"engine_start_s": time.perf_counter() - t0}
    floor_dir = tempfile.mkdtemp(prefix="vime-bench-floor-", dir="/dev/shm")
    # What a trainer keeps between its publishes (engine clients, shared-memory bucket files, a
    # broadcast group), as MegatronTrainer keeps it: without it every publish starts afresh.
    publisher = PublishLoop(token=server.auth_token)
    try:
        save_file(
            {n: t.to(wire).contiguous() for n, t in weights.items()}, os.path.join(floor_dir, "model.safetensors")
        )
        version = 0
        runs: dict[str, list[dict]] = {k: [] for k in cfgs}
        reload_times: list[float] = []
        for rep in range(args.repeats + 1):  # round 0 warms up (caches the engine's spec, forms groups)
            for key, cfg in cfgs.items():
                version += 1
                stats = publish_weights(weights.items(), [server.url], version, cfg, initial_version=0, loop=publisher)
                if not key.startswith("publish_disk"):
                    stats["engine"] = engine_rpc(server.url, server.auth_token, "collective_rpc", "vime_update_stats")[
                        0
                    ]
                if rep:
                    runs[key].append(stats)
            t0 = time.perf_counter()
            engine_rpc(server.url, server.auth_token, "collective_rpc", "reload_weights", {"weights_path": floor_dir})
            if rep:
                reload_times.append(time.perf_counter() - t0)
        out["reload_s"] = median(reload_times)
        out["runs"] = runs
    finally:
        publisher.close()
        shutil.rmtree(floor_dir, ignore_errors=True)
        server.shutdown()
    return out


def bench_model(name: str, shape: dict, args) -> dict:
    model_dir = build_tiny_model(
        REPO / ".cache" / "bench" / "models" / name,
        family="qwen3",
        seed=0,
        tie_word_embeddings=False,
        max_position_embeddings=512,
        **shape,
    )
    weights = load_file(str(model_dir / "model.safetensors"))
    params = sum(t.numel() for t in weights.values())
    wire = torch.bfloat16 if args.bf16 else torch.float32
    nbytes = params * wire.itemsize
    base_cfg = engine_settings(model_dir, args.bf16)
    result: dict = {"parameters": params, "wire_dtype": str(wire).removeprefix("torch."), "bytes": nbytes}
    result["memcpy_s"] = memcpy_seconds(weights, wire, args.repeats)
    result["memcpy_bytes_per_s"] = nbytes / result["memcpy_s"]

    # one engine per weight-transfer backend it is started with: vime_shm (shm, and disk), vime_broadcast (gloo)
    # the first bucket size also without the transfer checksums (--check-weight-transfer): their cost
    engines: dict[str, dict] = {}
    unchecked = {"check_weight_transfer": False, "update_weight_buffer_size": args.bucket_mib[0] * MiB}
    if "shm" in args.transports:
        engines["shm"] = {f"publish_shm_{mib}MiB": {"update_weight_buffer_size": mib * MiB} for mib in args.bucket_mib}
        engines["shm"][f"publish_shm_{args.bucket_mib[0]}MiB_unchecked"] = unchecked
        engines["shm"]["publish_disk_512MiB"] = {"weight_transport": "disk"}
    if "gloo" in args.transports:
        engines["gloo"] = {
            f"publish_gloo_{mib}MiB": {"weight_transport": "gloo", "update_weight_buffer_size": mib * MiB}
            for mib in args.bucket_mib
        }
        engines["gloo"][f"publish_gloo_{args.bucket_mib[0]}MiB_unchecked"] = {**unchecked, "weight_transport": "gloo"}
    for backend, overrides in engines.items():
        engine_cfg = {**base_cfg, "weight_transport": backend}
        measured = bench_engine(
            engine_cfg, {k: make_config({**engine_cfg, **o}) for k, o in overrides.items()}, weights, wire, args
        )
        suffix = "" if backend == "shm" else f"_{backend}_engine"
        result["engine_start_s" + suffix] = measured["engine_start_s"]
        result["reload_s" + suffix] = measured["reload_s"]
        result["reload_bytes_per_s" + suffix] = nbytes / measured["reload_s"]
        for key, stats_list in measured["runs"].items():
            result[key] = summarise(stats_list, nbytes, measured["reload_s"], result["memcpy_s"])
        checked, bare = (f"publish_{backend}_{args.bucket_mib[0]}MiB{suffix}" for suffix in ("", "_unchecked"))
        result[f"checksum_cost_ratio_{backend}"] = result[checked]["seconds"] / result[bare]["seconds"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--bucket-mib", type=int, nargs="*", default=[512, 64])
    parser.add_argument("--bf16", action="store_true", help="serve and send bf16 (default: fp32, the CPU default)")
    parser.add_argument(
        "--transports",
        nargs="*",
        default=["shm", "gloo"],
        choices=["shm", "gloo"],
        help="shm: an engine with the vime_shm backend (shm and disk publishes); gloo: one with "
        "vime_broadcast; each with its own reload floor",
    )
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    out = {
        "bench": "publish",
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "repeats": args.repeats,
        "models": {name: bench_model(name, MODELS[name], args) for name in args.models},
    }
    # The box is shared: the 1-minute load average says how much else ran meanwhile.
    out["machine"]["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
