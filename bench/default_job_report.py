"""Summarise main-job runs (one per seed) from their reports: reward gain (mean of the last 3
iterations minus the first 3), T_step and phase medians (iterations after the first), wall time.

    bash infra/main_job.sh --seed 1 --run-name default-r60-1     # ... for seeds 1, 2, 3
    .venv/bin/python bench/default_job_report.py --storage runs default-r60-1 default-r60-2 default-r60-3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vime_core.report.overhead import overhead  # noqa: E402
from vime_core.report.records import PHASES, read_records, reward_gain, run_dir  # noqa: E402


def summarise(storage: str, run: str) -> dict:
    records = read_records(storage, run)
    steady = records[1:] or records
    summary_path = Path(run_dir(storage, run)) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    walls = summary.get("iteration_walls") or []  # one per iteration flow run of the last train flow
    return {
        "run": run,
        "iterations": len(records),
        "reward_first3": statistics.fmean(r["reward_mean"] for r in records[:3]),
        "reward_last3": statistics.fmean(r["reward_mean"] for r in records[-3:]),
        "reward_gain": reward_gain(records),
        "t_step_median_s": statistics.median(r["t_step"] for r in steady),
        "phase_median_s": {p: statistics.median(r.get("t_" + p, 0.0) for r in steady) for p in PHASES},
        "train_flow_wall_s": summary.get("wall_seconds"),
        # the loop's period, flow-run start/end included: the honest seconds per iteration
        "iteration_wall_median_s": summary.get("iteration_wall_median"),
        # (sum of iteration walls - sum of actor compute) / sum of walls: vime_core/report/overhead.py
        "orchestration_overhead": overhead(walls, records[-len(walls):]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--storage", default=str(REPO / "runs"))
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "default_job.json"))
    p.add_argument("runs", nargs="+")
    args = p.parse_args()
    rows = [summarise(args.storage, r) for r in args.runs]
    result = {"bench": "default_job", "target_gain": 0.3, "target_t_step_s": 3.0, "runs": rows,
              "min_gain": min(r["reward_gain"] for r in rows),
              "median_t_step_s": statistics.median(r["t_step_median_s"] for r in rows)}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
