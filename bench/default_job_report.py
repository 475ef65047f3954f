"""The default job's figures: reward gain (mean of the last 3 iterations minus the first 3), T_step and
phase medians (iterations after the first), wall time, orchestration overhead and the run guard's
margins (how close each check came to its bound under the run's own settings) per run.

    bench/run.py default_job --seeds 1 2 3         # runs infra/main_job.sh once per seed, then this
    .venv/bin/python bench/default_job_report.py --storage runs RUN [RUN...]   # runs already made"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vime_core.config.loader import read_run_config  # noqa: E402
from vime_core.report.guard import GuardSettings, margins  # noqa: E402
from vime_core.report.overhead import overhead  # noqa: E402
from vime_core.report.records import read_records, reward_gain, run_dir  # noqa: E402


def summarise(storage: str, run: str) -> dict:
    records = read_records(storage, run)
    steady = records[1:] or records
    summary_path = Path(run_dir(storage, run)) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    walls = summary.get("iteration_walls") or []  # one per iteration flow run of the last train flow
    # every phase time the records carry (t_<phase>), whatever the phases are called
    phases = sorted(
        {
            k
            for r in steady
            for k, v in r.items()
            if k.startswith("t_") and k != "t_step" and isinstance(v, (int, float))
        }
    )
    return {
        "run": run,
        "iterations": len(records),
        "reward_first3": statistics.fmean(r["reward_mean"] for r in records[:3]),
        "reward_last3": statistics.fmean(r["reward_mean"] for r in records[-3:]),
        "reward_gain": reward_gain(records),
        "t_step_median_s": statistics.median(r["t_step"] for r in steady),
        "phase_median_s": {p[2:]: statistics.median(r.get(p, 0.0) for r in steady) for p in phases},
        "train_flow_wall_s": summary.get("wall_seconds"),
        # the loop's period, flow-run start/end included: the honest seconds per iteration
        "iteration_wall_median_s": summary.get("iteration_wall_median"),
        # (sum of iteration walls - sum of actor compute) / sum of walls: vime_core/report/overhead.py
        "orchestration_overhead": overhead(walls, records[-len(walls) :]),
        # per check, the worst value against its bound (ratio 1 would have fired): issue 45's defaults
        # must never fire on the default job, on the CPU box or a GPU (bench/gpu/run_learning_h200.sh)
        "guard_margins": margins(records, GuardSettings.of(read_run_config(storage, run))),
    }


def run_jobs(seeds: list[int], storage: str, job_args: list[str]) -> list[str]:
    """One `infra/main_job.sh` per seed, one after the other; the run names."""
    stamp = time.strftime("%Y%m%d%H%M%S")
    runs = []
    for seed in seeds:
        run = f"default-job-s{seed}-{stamp}"
        cmd = [
            "bash",
            str(REPO / "infra" / "main_job.sh"),
            "--seed",
            str(seed),
            "--run-name",
            run,
            "--storage-uri",
            storage,
            *job_args,
        ]
        print(f"[default_job] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, cwd=REPO, check=True)
        runs.append(run)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--storage", default=str(REPO / "runs"))
    p.add_argument("--seeds", type=int, nargs="*", default=None, help="run the default job once per seed first")
    p.add_argument("--job-args", default="", help="extra `vime train` flags for --seeds' runs (one string)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("runs", nargs="*", help="runs already made (their names under --storage)")
    args = p.parse_args()
    runs = list(args.runs)
    if args.seeds:
        runs += run_jobs(args.seeds, args.storage, shlex.split(args.job_args))
    if not runs:
        p.error("name runs, or --seeds to make them")
    rows = [summarise(args.storage, r) for r in runs]
    result = {
        "bench": "default_job",
        "target_gain": 0.3,
        "target_t_step_s": 3.0,
        "runs": rows,
        "min_gain": min(r["reward_gain"] for r in rows),
        "median_t_step_s": statistics.median(r["t_step_median_s"] for r in rows),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
