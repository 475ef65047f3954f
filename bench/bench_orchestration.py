"""Orchestration overhead per iteration on the default configuration: what vime adds around the work
(Prefect flow and task runs, Ray calls and transfers, the report, persist where not hidden).

    overhead      = sum over steady iterations of T_iteration - sum of the phases' compute measured
                    inside the actors (rollout generate + build, train, rank 0's publish)
    overhead_frac = overhead / sum of T_iteration

Sums, not per-iteration medians: with rollout_prefetch part of rollout k+1 runs inside iteration k,
and over a window the parts entering and leaving cancel. Both modes (rollout_prefetch on, and
serial) run interleaved `--repeats` times, each on its own Ray head.

    bench/run.py orchestration --iterations 32 --repeats 3"""

import argparse
import cProfile
import json
import logging
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vime_core.cluster import local_head  # noqa: E402
from vime_core.cluster.run_actors import teardown  # noqa: E402
from vime_core.config import VimeConfig  # noqa: E402
from vime_core.report.overhead import compute_split, overhead, steady_window  # noqa: E402
from vime_core.report.records import read_records  # noqa: E402


# the record's task-side times: each phase task's wall inside its task run
TASK_TIMES = ("t_rollout", "t_persist", "t_train", "t_sync")


class PrefectRetryCounter(logging.Handler):
    """Counts the Prefect client's retries of retryable answers (a 503 from a locked SQLite
    database costs a fixed back-off each); Prefect logs each one at DEBUG. While attached, the
    client's logger lets DEBUG through to this handler only: what it logged before (at its
    effective level and above) still goes on to the console's handlers, nothing below."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.count = 0
        self._logger = logging.getLogger("prefect.client")
        self._level, self._propagate = self._logger.level, self._logger.propagate
        self._passed = self._logger.getEffectiveLevel()  # what reached the console before

    @classmethod
    def attach(cls) -> "PrefectRetryCounter":
        counter = cls()
        counter._logger.addHandler(counter)
        counter._logger.setLevel(logging.DEBUG)
        counter._logger.propagate = False  # emit passes on what the console showed before
        return counter

    def detach(self) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        self._logger.propagate = self._propagate

    def emit(self, record: logging.LogRecord) -> None:
        if "retryable" in record.getMessage():
            self.count += 1
        if record.levelno >= self._passed and self._propagate and self._logger.parent is not None:
            self._logger.parent.handle(record)


# Each mode's flags over the default job. `tis` is the on-policy baseline of `off_policy`: both
# request the engines' log-probs and weight the loss by TIS; only the overlap differs.
MODES = {
    "prefetch": {"rollout_prefetch": True},
    "serial": {"rollout_prefetch": False},
    "tis": {"rollout_prefetch": True, "use_tis": True},
    "off_policy": {"rollout_prefetch": True, "use_tis": True, "async_staleness": 1},
    # `prefetch` with the flow and task runs' INFO lines kept from Prefect's API, as before
    # flows/settings.send_run_logs: what the UI's logs of every iteration cost
    "no_run_logs": {"rollout_prefetch": True},
}
WITHOUT_RUN_LOGS = {"no_run_logs"}


def run_logs(on: bool) -> None:
    """The flows' `send_run_logs` as they call it (on), or one that leaves Prefect's run loggers at
    the console's level, so their INFO lines reach neither the API nor the console (off)."""
    # boundary: main() sets Prefect's environment before anything imports it
    import flows.iteration
    import flows.replay
    import flows.settings
    import flows.train

    def at_console_level() -> None:
        for name in flows.settings.RUN_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)

    for module in (flows.train, flows.iteration, flows.replay):
        module.send_run_logs = flows.settings.send_run_logs if on else at_console_level


def run_mode(iterations: int, mode: str, profile: str = "") -> dict:
    """One run of the real `train` flow on its own local Ray head; its summary has the wall time
    of every iteration flow run as the train flow saw it."""
    # boundary: main() sets Prefect's and Ray's environment before anything imports them
    from flows.settings import apply_env_defaults
    from flows.train import train

    apply_env_defaults()  # as `vime train` does, before the first flow run starts Prefect's server
    run_logs(mode not in WITHOUT_RUN_LOGS)
    retries = PrefectRetryCounter.attach()
    work = Path(tempfile.mkdtemp(prefix="vime-bench-orch-"))
    address = local_head.start_local_head(num_gpus=1, temp_dir=work / "ray")
    cfg = VimeConfig(
        run_name=f"bench-orch-{mode.replace('_', '-')}",
        storage_uri=str(work / "store"),
        ray_address=address,
        num_rollout=iterations,
        save_interval=10**6,
        **MODES[mode],
    )
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler is not None:
            profiler.enable()
        walls = train(cfg)["iteration_walls"]
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(profile)
        records = read_records(str(work / "store"), cfg.run_name)
    finally:
        retries.detach()
        try:
            teardown(cfg.run_name)
        finally:
            import ray  # boundary: main() sets Ray's environment before anything imports it

            ray.shutdown()  # the next mode starts another head; this driver must not keep the old one
            local_head.stop_local_head(temp_dir=work / "ray")

    rows = [
        {
            "rollout_id": rec["rollout_id"],
            "t_iteration": wall,
            "t_step_in_flow": rec.get("t_step"),
            "t_persist": rec.get("t_persist", 0.0),
            "compute": compute_split(rec),
            "prefetched": bool(rec.get("prefetched")),
            # each task's own time (inside the Prefect task run) next to the actors' compute
            "task_s": {k: rec.get(k) for k in TASK_TIMES},
        }
        for wall, rec in zip(walls, records)
    ]
    steady = steady_window(rows)
    split = overhead(walls, records)
    return {
        "mode": mode,
        "flags": MODES[mode],
        "iterations_in_window": split["window"],
        "mean_t_iteration_s": split["mean_wall_s"],
        "median_t_iteration_s": statistics.median(r["t_iteration"] for r in steady),
        "mean_compute_s": split["mean_compute_s"],
        "mean_overhead_s": split["mean_overhead_s"],
        "overhead_frac": split["fraction"],
        "median_compute_s": {k: statistics.median(r["compute"][k] for r in steady) for k in steady[0]["compute"]},
        "median_t_persist_s": statistics.median(r["t_persist"] for r in steady),
        "median_task_s": {k: statistics.median(r["task_s"][k] or 0.0 for r in steady) for k in TASK_TIMES},
        "median_t_step_in_flow_s": statistics.median(r["t_step_in_flow"] for r in steady),
        "prefect_api_retries": retries.count,
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iterations", type=int, default=32)
    p.add_argument("--modes", default="prefetch,serial", help=f"comma list of {', '.join(MODES)}")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of each mode, interleaved (prefetch, serial, prefetch, ...)"
    )
    p.add_argument("--profile", default="", help="write cProfile stats of each train flow run to PATH.<mode>")
    p.add_argument("--out", default=None, help="also write the JSON here, with every iteration's row")
    args = p.parse_args()

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="vime-bench-prefect-"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

    load_start = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for mode in args.modes.split(","):
            runs.setdefault(mode, []).append(
                run_mode(args.iterations, mode, f"{args.profile}.{mode}" if args.profile else "")
            )
    summary_keys = ("mean_t_iteration_s", "mean_compute_s", "mean_overhead_s", "overhead_frac")
    modes = {
        mode: {
            **{f"median_of_runs_{k}": statistics.median(r[k] for r in rs) for k in summary_keys},
            "runs": [{k: v for k, v in r.items() if k != "rows"} for r in rs],
        }
        for mode, rs in runs.items()
    }
    result = {
        "bench": "orchestration_overhead",
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores (shared, noisy); load 1m {load_start:.1f} at start, "
        f"{os.getloadavg()[0]:.1f} at end",
        "config": "default job (32 prompts x 16 samples, tiny model), one engine + one Megatron actor colocated",
        "definition": "vime_core/report/overhead.py: (sum of T_iteration - sum of actor compute) / sum of T_iteration "
        "over iterations 1..N-2",
        "iterations_per_run": args.iterations,
        "repeats": args.repeats,
        "target_overhead_frac": 0.02,
        "modes": modes,
    }
    if "prefetch" in modes and "serial" in modes:
        result["t_iteration_ratio_prefetch_over_serial"] = (
            modes["prefetch"]["median_of_runs_mean_t_iteration_s"]
            / modes["serial"]["median_of_runs_mean_t_iteration_s"]
        )
        result["per_repeat_ratio"] = [
            a["mean_t_iteration_s"] / b["mean_t_iteration_s"] for a, b in zip(runs["prefetch"], runs["serial"])
        ]
    if "prefetch" in modes and "no_run_logs" in modes:  # the runs' INFO lines in Prefect's API, and not
        result["t_iteration_ratio_run_logs_over_none"] = (
            modes["prefetch"]["median_of_runs_mean_t_iteration_s"]
            / modes["no_run_logs"]["median_of_runs_mean_t_iteration_s"]
        )
        result["per_repeat_ratio_run_logs_over_none"] = [
            a["mean_t_iteration_s"] / b["mean_t_iteration_s"] for a, b in zip(runs["prefetch"], runs["no_run_logs"])
        ]
        result["median_t_step_in_flow_ratio_run_logs_over_none"] = statistics.median(
            a["median_t_step_in_flow_s"] / b["median_t_step_in_flow_s"]
            for a, b in zip(runs["prefetch"], runs["no_run_logs"])
        )
    if "off_policy" in modes and "tis" in modes:  # one step off-policy against the same job on-policy
        result["t_iteration_ratio_off_policy_over_tis"] = (
            modes["off_policy"]["median_of_runs_mean_t_iteration_s"] / modes["tis"]["median_of_runs_mean_t_iteration_s"]
        )
        result["per_repeat_ratio_off_policy_over_tis"] = [
            a["mean_t_iteration_s"] / b["mean_t_iteration_s"] for a, b in zip(runs["off_policy"], runs["tis"])
        ]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps({**result, "rows": {m: [r["rows"] for r in rs] for m, rs in runs.items()}}, indent=2) + "\n"
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
