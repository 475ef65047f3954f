"""The train job: bootstrap once, then one iteration flow run per rollout id.

Resumable: bootstrap restores the run's latest checkpoint and iterations whose batch is already
stored load it instead of generating it again.
"""

from __future__ import annotations

import json
import time

from prefect import flow, get_run_logger

from flows.iteration import iteration
from flows.settings import without_heartbeats
from tasks.bootstrap import bootstrap, prepare_assets
from tasks.checkpoint import compact_index, export_hf
from vime_core.config import VimeConfig
from vime_core.config.loader import describe, dump_config
from vime_core.report.curve import preload as preload_curve
from vime_core.report.records import read_records, reward_gain, run_dir


@flow(name="train", flow_run_name="train-{config.run_name}", log_prints=True)
def train(config: VimeConfig) -> dict:
    log = get_run_logger()
    t0 = time.perf_counter()
    preload_curve()  # while bootstrap runs: the first reward curve then draws in ~0.1 s
    config = prepare_assets(config)
    log.info("resolved configuration:\n%s", describe(config))
    if "://" not in config.storage_uri:
        dump_config(config, f"{run_dir(config.storage_uri, config.run_name)}/config.json")
    boot = bootstrap(config)
    start = config.start_rollout_id if config.start_rollout_id is not None else boot["next_rollout_id"]
    iteration_walls = []  # each iteration flow run, start to end, as this flow sees it
    with without_heartbeats():
        for rollout_id in range(start, config.num_rollout):
            t_iter = time.perf_counter()
            iteration(config, rollout_id)
            iteration_walls.append(time.perf_counter() - t_iter)
    compact_index(config)
    records = read_records(config.storage_uri, config.run_name)
    root = run_dir(config.storage_uri, config.run_name)
    export = export_hf(config, run_dir(config.storage_uri, config.run_name, "exports"))
    summary = {
        "run_name": config.run_name,
        "iterations": len(records),
        "reward_first3": _mean([r.get("reward_mean") for r in records[:3]]),
        "reward_last3": _mean([r.get("reward_mean") for r in records[-3:]]),
        "reward_gain": reward_gain(records),
        "t_step_median": _median([r.get("t_step") for r in records]),
        # the period of the loop: T_step plus the flow run's own start and end (what a user waits)
        "iteration_wall_median": _median(iteration_walls[1:] or iteration_walls),
        "iteration_walls": iteration_walls,
        "wall_seconds": time.perf_counter() - t0,
        "batches": run_dir(config.storage_uri, config.run_name, "batches"),
        "checkpoints": run_dir(config.storage_uri, config.run_name, "checkpoints"),
        "hf_export": export,
        "metrics": f"{root}/metrics.jsonl",
        "reward_curve": f"{root}/reward_curve.png",
    }
    summary["summary"] = write_summary(config, summary)
    printed = {k: v for k, v in summary.items() if k != "iteration_walls"}  # the file has them all
    log.info("summary:\n%s", json.dumps(printed, indent=2))
    return summary


def write_summary(config: VimeConfig, summary: dict) -> str:
    import fsspec

    fs, root = fsspec.core.url_to_fs(run_dir(config.storage_uri, config.run_name))
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/summary.json", "w") as f:
        f.write(json.dumps(summary, indent=2, default=str) + "\n")
    return f"{run_dir(config.storage_uri, config.run_name)}/summary.json"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None
