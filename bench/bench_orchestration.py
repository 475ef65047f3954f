"""Orchestration overhead per iteration on the default configuration.

    overhead = T_iteration (wall time of the iteration flow run, measured by its caller)
             - sum of the phases' compute measured inside the actors:
               rollout generate + build (RolloutManager), batch write (Ray task next to the data),
               train (MegatronTrainer), weight publish (rank 0's publish_weights total)

So the overhead is everything vime adds around the work: Prefect flow/task runs, Ray actor
calls and object transfers, the report. Target: < 2% of T_step. Also reported: the same split
per phase. Prints JSON (medians over the iterations after the first, which includes warm-up)
and writes bench/results/bench_orchestration.json.

    .venv/bin/python bench/bench_orchestration.py --iterations 12
"""


import argparse
import cProfile
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--profile", default="", help="write cProfile stats of the iterations after the first here")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_orchestration.json"))
    args = p.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="vime-bench-prefect-"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    from prefect import flow

    from flows.iteration import iteration
    from flows.settings import without_heartbeats
    from tasks.bootstrap import bootstrap, prepare_assets
    from vime_core.cluster import local_head
    from vime_core.cluster.run_actors import teardown
    from vime_core.config import VimeConfig
    from vime_core.report.records import read_records

    work = Path(tempfile.mkdtemp(prefix="vime-bench-orch-"))
    address = local_head.start_local_head(num_gpus=1, temp_dir=work / "ray")
    cfg = VimeConfig(run_name="bench-orch", storage_uri=str(work / "store"), ray_address=address,
                     num_rollout=args.iterations, save_interval=10**6)

    @flow(name="bench-orchestration")
    def run(config: VimeConfig) -> list[float]:
        config = prepare_assets(config)
        bootstrap(config)
        walls = []
        profiler = cProfile.Profile() if args.profile else None
        with without_heartbeats():
            for k in range(config.num_rollout):
                if profiler is not None and k == 1:
                    profiler.enable()
                t0 = time.perf_counter()
                iteration(config, k)
                walls.append(time.perf_counter() - t0)
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
        return walls

    try:
        walls = run(cfg)
        records = read_records(cfg.storage_uri if "://" in cfg.storage_uri else str(work / "store"), cfg.run_name)
    finally:
        try:
            teardown(cfg.run_name)
        finally:
            local_head.stop_local_head(temp_dir=work / "ray")

    rows = []
    for wall, rec in zip(walls, records):
        compute = {
            "rollout": rec.get("time_total_s", 0.0) + rec.get("time_build_s", 0.0),
            "persist": rec.get("t_write_s", 0.0),
            "train": rec.get("train_time_s", 0.0),
            "sync": rec.get("publish_s", 0.0),
        }
        total = sum(compute.values())
        rows.append({"rollout_id": rec["rollout_id"], "t_iteration": wall, "t_step": rec.get("t_step"),
                     "compute": compute, "overhead_s": wall - total, "overhead_frac": (wall - total) / wall})
    steady = rows[1:] or rows
    med = lambda key: statistics.median(r[key] for r in steady)
    result = {
        "bench": "orchestration_overhead",
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores (shared, noisy)",
        "config": f"default job ({cfg.rollout_batch_size} prompts x {cfg.n_samples_per_prompt} samples, tiny model), one engine + one Megatron actor colocated",
        "iterations": len(rows),
        "median_t_iteration_s": med("t_iteration"),
        "median_overhead_s": med("overhead_s"),
        "median_overhead_frac": med("overhead_frac"),
        "median_compute_s": {k: statistics.median(r["compute"][k] for r in steady) for k in steady[0]["compute"]},
        "target_overhead_frac": 0.02,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
