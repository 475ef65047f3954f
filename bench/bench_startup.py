"""Startup of `vime train`, from the command to its first iteration (startup_s, and the summary's marks):
the early start (the default) against --no-early-start, the early start without engine_prestart, and
(on CPU) the engine as vLLM's three processes (--no-vllm-cpu-single-process) or with its engine core
spawned instead of forked (vllm_side/api_server.py) against one process forked from the front end,
and with a cold vLLM cache, the model class inspected in vLLM's subprocess or in the API server, or
the cache given back from the archives an earlier start stored (vllm_cache_uri).
Each run is the real command on the default job with one iteration, a fresh loopback Ray head and its
own Prefect home; the modes interleave --repeats times, each round rotated (round_order), and
`early_again` (the default twice: an A/A control) gives the bench's own noise. `base` is the default
run from another checkout (--base-tree, e.g. a `git worktree` of the commit before a change, sharing
this one's environments): a change measured against the code before it, in the same run.
Run: bench/run.py startup [--repeats N] [--modes ...] [--base-tree DIR]; nothing else should run on
the box meanwhile."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from provenance import tree_sha  # noqa: E402
from vime_core.cluster import local_head  # noqa: E402

MODES = {
    "early": ["--early-start"],
    "early_no_prestart": ["--early-start", "--no-engine-prestart"],
    "bootstrap": ["--no-early-start"],
    "cpu_engine_two_processes": ["--early-start", "--no-vllm-cpu-single-process"],
    "cpu_engine_core_spawned": ["--early-start", "--vllm-env", "VIME_VLLM_SPAWN_ENGINE_CORE=1"],
    # a fresh host's cold vLLM cache ({work}: the run's own folder), the model class inspected the way
    # vLLM does it (a subprocess) or in the API server's process (vllm_side/api_server.py)
    "cold_vllm_cache": ["--early-start", "--vllm-env", "VLLM_CACHE_ROOT={work}/vllm-cache"],
    "cold_vllm_cache_inspect_here": [
        "--early-start",
        "--vllm-env",
        "VLLM_CACHE_ROOT={work}/vllm-cache",
        "VIME_VLLM_INSPECT_IN_PROCESS=1",
    ],
    # the same cold cache, given back from the archives an earlier start stored ({bench}: the bench's
    # folder; a seeding run, not counted, stores it first): vllm_cache_uri (engines/vllm_cache.py)
    "cold_vllm_cache_carried": [
        "--early-start",
        "--vllm-env",
        "VLLM_CACHE_ROOT={work}/vllm-cache",
        "--vllm-cache-uri",
        "{bench}/vllm-cache-store",
    ],
    # the default again: an A/A control, whose ratio to `early` is the bench's own noise and order effect
    "early_again": ["--early-start"],
    # Ray's metrics collection and its OpenTelemetry exporter off, on the head and in the driver (HEAD_ENV)
    "early_ray_metrics_off": ["--early-start"],
    # the default, run from the --base-tree checkout
    "base": ["--early-start"],
}
# the environment a mode's Ray head (its raylet, so every worker) and `vime train` start with
HEAD_ENV = {"early_ray_metrics_off": {"RAY_enable_metrics_collection": "0", "RAY_enable_open_telemetry": "0"}}
SEEDED = "cold_vllm_cache_carried"  # the mode whose archives a first, uncounted run stores


def run_once(mode: str, work: Path, bench: Path, repo: Path = REPO) -> dict:
    """One `vime train --num-rollout 1` of the checkout `repo` on its own Ray head; its summary's
    startup figures."""
    work.mkdir(parents=True)
    head_env = HEAD_ENV.get(mode, {})
    before = {k: os.environ.get(k) for k in head_env}
    os.environ.update(head_env)  # start_local_head starts `ray start` with this process's environment
    try:
        address = local_head.start_local_head(num_gpus=1, temp_dir=work / "ray")
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    env = dict(os.environ, **head_env, PREFECT_HOME=str(work / "prefect"), PYTHONPATH=str(repo))
    cmd = [
        sys.executable,
        "-m",
        "flows.cli",
        "train",
        "--run-name",
        f"bench-startup-{mode}",
        "--storage-uri",
        str(work / "store"),
        "--ray-address",
        address,
        "--num-rollout",
        "1",
        *(a.replace("{work}", str(work)).replace("{bench}", str(bench)) for a in MODES[mode]),
    ]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    finally:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "flows.cli",
                "teardown",
                "--run-name",
                f"bench-startup-{mode}",
                "--ray-address",
                address,
            ],
            cwd=repo,
            env=env,
            capture_output=True,
            timeout=120,
        )
        local_head.stop_local_head(temp_dir=work / "ray")
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}: vime train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout[proc.stdout.index("{") :])
    return {
        "mode": mode,
        "startup_s": summary["startup_s"],
        "wall_s": time.monotonic() - t0,
        "startup_marks_s": summary.get("startup_marks_s"),
    }


def round_order(modes: list[str], i: int) -> list[str]:
    """The modes of round `i`, rotated by i: over len(modes) rounds each mode runs once in each
    position (a loaded box made the mode measured second faster, whichever it was)."""
    k = i % len(modes)
    return modes[k:] + modes[:k]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--modes",
        nargs="+",
        choices=list(MODES),
        default=[m for m in MODES if m != "base"],
        help="modes to run (early always; base with --base-tree)",
    )
    p.add_argument("--base-tree", type=Path, default=None, help="the checkout the `base` mode runs (its own git tree)")
    args = p.parse_args()
    modes = ["early", *(m for m in args.modes if m != "early")]
    if ("base" in modes) != (args.base_tree is not None):
        p.error("--modes base and --base-tree go together")
    repos = {"base": args.base_tree.resolve()} if args.base_tree else {}
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="vime-bench-startup-"))
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    seeds = {SEEDED: run_once(SEEDED, root / f"{SEEDED}-seed", root)} if SEEDED in modes else {}
    for i in range(args.repeats):
        for mode in round_order(modes, i):
            runs[mode].append(run_once(mode, root / f"{mode}-{i}", root, repos.get(mode, REPO)))
    medians = {m: statistics.median(r["startup_s"] for r in rs) for m, rs in runs.items()}
    result = {
        "bench": "startup",
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores (shared, noisy); load 1m {load_start:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end",
        "config": "the default job, one iteration, one engine + one Megatron actor colocated, a fresh Ray head and "
        "Prefect home per run",
        "repeats": args.repeats,
        **({"base_tree_sha": tree_sha(repos["base"]) or "unknown"} if "base" in repos else {}),
        "startup_s_median": medians,
        **{f"ratio_early_over_{m}": medians["early"] / medians[m] for m in modes if m != "early"},
        **{
            f"per_repeat_ratio_early_over_{m}": [a["startup_s"] / b["startup_s"] for a, b in zip(runs["early"], rs)]
            for m, rs in runs.items()
            if m != "early"
        },
        "runs": runs,
        "seeding_runs": seeds,  # not counted: they stored the archives the carried runs restore
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
