"""A run that survives random kills: one `vime train` run (one vLLM CPU engine, one Megatron actor) while
engine, trainer and driver processes are killed at random times, then a check of the run's invariants.

    bench/run.py faults --num-rollout 15 --kills 4 --seed 0"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from vime_core.cluster import local_head  # noqa: E402
from vime_core.cluster.connect import ensure_ray, LOOPBACK_ENV  # noqa: E402
from vime_core.cluster.run_actors import attach, teardown  # noqa: E402
from vime_core.config import VimeConfig  # noqa: E402
from vime_core.data.validation import validate_trainable  # noqa: E402
from vime_core.storage import BatchStore  # noqa: E402

KINDS = ("engine", "trainer", "driver")
VLLM_SERVER = b"vllm.entrypoints.openai.api_server"
TRAINER_TITLE = b"ray::MegatronTrainer"
LOGPROB_TOLERANCE = 2e-3  # as tests/integration/flows/test_faults.py


def settings(a: argparse.Namespace, store: Path, ray_address: str) -> dict:
    """The run's settings (VimeConfig fields): small batches, so an iteration takes seconds."""
    return dict(
        run_name=a.run_name,
        storage_uri=str(store),
        ray_address=ray_address,
        seed=a.seed,
        num_rollout=a.num_rollout,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        micro_batch_size=8,
        save_interval=a.save_interval,
        vllm_server_concurrency=64,
        iteration_retry_delay_s=0.5,
        check_weight_update_equal=True,
    )


def job_args(run: dict) -> list[str]:
    """The `vime train` command of the run (the same at every launch: that is the resume)."""
    args = [sys.executable, "-m", "flows.cli", "train"]
    for name, value in run.items():
        flag = f"--{name.replace('_', '-')}"
        args += [flag] if value is True else [flag, str(value)]
    return args


# ---- finding the processes to kill -----------------------------------------------------------
def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, pgid) of `pid`, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[2])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def head_processes(pgid: int) -> list[int]:
    """The Ray head's processes (its process group) and everything they started, e.g. the vLLM
    server, which runs in a session of its own under the engine actor."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _stat(int(p))) is not None}
    tree = {pid for pid, (_, group) in stats.items() if group == pgid}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _) in stats.items() if ppid in tree and pid not in tree}
        tree |= children
        grew = bool(children)
    return sorted(tree)


def find_victim(kind: str, pgid: int) -> int | None:
    for pid in head_processes(pgid):
        cmd = _cmdline(pid)
        if kind == "engine" and VLLM_SERVER in cmd:
            return pid
        if kind == "trainer" and cmd.startswith(TRAINER_TITLE):
            return pid
    return None


# ---- the run ---------------------------------------------------------------------------------
def raw_records(store: Path, run: str) -> list[dict]:
    path = store / "reports" / run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_line(log: Path, needle: str) -> str:
    lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if needle in l]
    return lines[-1][-400:] if lines else ""


class Job:
    """Launches of `vime train` for one run, each in its own session."""

    def __init__(self, args: list[str], workdir: Path):
        self.args, self.workdir = args, workdir
        self.launches, self.proc, self.log = 0, None, None
        self.stops: list[dict] = []  # launches that ended by themselves without finishing

    def launch(self) -> None:
        self.launches += 1
        self.log = self.workdir / f"driver-{self.launches}.log"
        env = {**os.environ, "PREFECT_HOME": str(self.workdir / "prefect")}
        self.proc = subprocess.Popen(
            self.args, cwd=REPO, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def run_with_kills(a: argparse.Namespace, job: Job, store: Path, pgid: int, rng: random.Random) -> dict:
    """Drive the run to its end (or `--timeout-s`) while killing; returns what happened.

    After the first iteration, `--kills` kills, one at a time, each after a random pause and only once
    the run progressed, the kinds in a seeded order holding each at least once: engine (the health
    monitor restarts it), trainer (the iteration is retried and bootstrap rebuilds it from its
    checkpoint), driver (the command runs again and resumes). A driver that gives up is also run again,
    up to `--max-launches`."""
    plan = list(KINDS) + [rng.choice(KINDS) for _ in range(max(0, a.kills - len(KINDS)))]
    rng.shuffle(plan)
    plan = plan[: a.kills]
    kills: list[dict] = []
    t0 = time.monotonic()
    job.launch()
    progress_at_kill = 0  # records written when the last kill happened: wait for more
    next_kill_at = None
    while time.monotonic() - t0 < a.timeout_s:
        if job.proc.poll() is not None:
            if job.proc.returncode == 0:
                return {"finished": True, "kills": kills, "wall_s": time.monotonic() - t0}
            job.stops.append({"launch": job.launches, "rc": job.proc.returncode, "error": last_line(job.log, "failed")})
            if job.launches >= a.max_launches:
                break
            job.launch()
        progress = len(raw_records(store, a.run_name))
        done = {r["rollout_id"] for r in raw_records(store, a.run_name)}
        if plan and progress > progress_at_kill and len(done) < a.num_rollout - 1:
            if next_kill_at is None:
                next_kill_at = time.monotonic() + rng.uniform(a.min_gap_s, a.max_gap_s)
            elif time.monotonic() >= next_kill_at:
                kind = plan[0]
                pid = job.proc.pid if kind == "driver" else find_victim(kind, pgid)
                if pid is not None:
                    at = {
                        "kind": kind,
                        "pid": pid,
                        "t_s": round(time.monotonic() - t0, 1),
                        "records_before": progress,
                        "rollout_in_progress": max(done, default=-1) + 1,
                    }
                    if kind == "driver":
                        job.kill()
                        job.launch()
                    elif kind == "engine" and os.getpgid(pid) != pgid:  # its own session: the server and its workers
                        os.killpg(os.getpgid(pid), signal.SIGKILL)
                    else:
                        os.kill(pid, signal.SIGKILL)
                    kills.append(at)
                    plan.pop(0)
                    print(
                        f"[bench] killed {kind} (pid {pid}) at {at['t_s']} s, rollout {at['rollout_in_progress']}",
                        flush=True,
                    )
                    progress_at_kill, next_kill_at = progress, None
        time.sleep(0.5)
    job.kill()
    return {"finished": False, "kills": kills, "wall_s": time.monotonic() - t0}


# ---- the invariants --------------------------------------------------------------------------
def check_invariants(a: argparse.Namespace, run: dict) -> dict:
    """Every rollout id 0..N-1 has exactly one published batch passing its checksum and the trainer's
    check; one optimizer step per rollout id trained; the engine's weight version equals the trainer's
    (N + 1) and every sync's probe agreed; nothing quarantined, no unpublished batch object left."""
    import ray  # boundary: main() sets LOOPBACK_ENV before anything imports Ray

    n, store_path, ray_address = a.num_rollout, Path(run["storage_uri"]), run["ray_address"]
    store = BatchStore(str(store_path))
    refs = store.list_batches(a.run_name)
    ids = [r.rollout_id for r in refs]
    untrainable = []
    for r in refs:
        try:
            batch, _ = store.read(a.run_name, r.rollout_id)  # checksum verified
            validate_trainable(batch)
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the bench prints everything
            untrainable.append({"rollout_id": r.rollout_id, "error": f"{type(exc).__name__}: {exc}"[:300]})
    published = {r.key for r in refs}
    objects = [k for k in store.location.list_keys(f"batches/{a.run_name}")]
    records = raw_records(store_path, a.run_name)
    per_id: dict[int, int] = {}
    for r in records:
        per_id[r["rollout_id"]] = per_id.get(r["rollout_id"], 0) + 1
    last = {r["rollout_id"]: r for r in records}
    weight_checks = [r["weight_check"] for r in last.values() if "weight_check" in r]
    bad_checks = [c for c in weight_checks if c.get("max_abs_diff", 1.0) >= LOGPROB_TOLERANCE]

    cfg = VimeConfig(**run)
    ensure_ray(ray_address)
    manager, trainers = attach(cfg)
    state = trainers.rank0("state")
    engine_versions = ray.get(manager.weight_versions.remote())
    steps_expected = n * cfg.num_steps_per_rollout
    return {
        "one_batch_per_rollout_id": ids == list(range(n)),
        "lost_rollout_ids": sorted(set(range(n)) - set(ids)),
        "untrainable_batches": untrainable,
        "unpublished_batch_objects": sorted(set(objects) - published),
        "quarantined": len(store.quarantined(a.run_name)),
        "optimizer_steps": state["optimizer_steps"],
        "optimizer_steps_expected": steps_expected,
        "trained_twice": state["optimizer_steps"] > steps_expected,
        "skipped": state["optimizer_steps"] < steps_expected or state["last_trained_rollout_id"] != n - 1,
        "last_trained_rollout_id": state["last_trained_rollout_id"],
        "trainer_weight_version": state["weight_version"],
        "engine_weight_versions": engine_versions,
        "engines_match_trainer": engine_versions == [state["weight_version"]] and state["weight_version"] == n + 1,
        "weight_checks": len(weight_checks),
        "weight_checks_over_tolerance": len(bad_checks),
        # iterations run again after a rebuilt trainer went back to its checkpoint (the optimizer
        # state went back with it, so these do not count as trained twice)
        "records_per_rollout_id": {str(k): v for k, v in sorted(per_id.items()) if v > 1},
        "iteration_t_step_median_s": _median([r.get("t_step") for r in last.values()]),
    }


def _median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 3) if xs else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-rollout", type=int, default=30)
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seeds the kill order and times, and the run")
    p.add_argument("--min-gap-s", type=float, default=0.3, help="shortest pause before a kill, once the run moved on")
    p.add_argument(
        "--max-gap-s", type=float, default=2.0, help="longest pause (an iteration takes ~0.5 s on 2 CPU cores)"
    )
    p.add_argument("--save-interval", type=int, default=3)
    p.add_argument("--max-launches", type=int, default=8, help="launches of `vime train` in all")
    p.add_argument("--timeout-s", type=float, default=2400.0)
    p.add_argument("--run-name", default="bench-faults")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()

    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    workdir = Path(tempfile.mkdtemp(prefix="vime-bench-faults-"))
    store = workdir / "store"
    rng = random.Random(a.seed)
    address = local_head.start_local_head(num_gpus=1, temp_dir=workdir / "ray")
    pgid = json.loads((workdir / "ray" / local_head.STATE_FILE).read_text())["pgid"]
    run = settings(a, store, address)
    job = Job(job_args(run), workdir)
    # SIGTERM (a timeout, a Ctrl-C of the caller's script) unwinds through `finally`: the run's
    # driver, engines and Ray head go down with the bench
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        outcome = run_with_kills(a, job, store, pgid, rng)
        invariants = check_invariants(a, run) if outcome["finished"] else {}
    finally:
        job.kill()
        try:
            teardown(a.run_name)
        except Exception as exc:  # noqa: BLE001 - the head goes down next anyway
            print(f"[bench] teardown: {exc}", file=sys.stderr)
        local_head.stop_local_head(temp_dir=workdir / "ray")
    counts = {kind: sum(k["kind"] == kind for k in outcome["kills"]) for kind in KINDS}
    result = {
        "bench": "faults",
        "seed": a.seed,
        "num_rollout": a.num_rollout,
        "save_interval": a.save_interval,
        "kills_requested": a.kills,
        "kills": counts,
        "kill_log": outcome["kills"],
        "finished": outcome["finished"],
        "driver_launches": job.launches,
        "driver_stops": job.stops,  # launches that gave up by themselves (then run again)
        "wall_s": round(outcome["wall_s"], 1),
        "invariants": invariants,
        "ok": bool(
            outcome["finished"]
            and invariants
            and invariants["one_batch_per_rollout_id"]
            and not invariants["untrainable_batches"]
            and not invariants["trained_twice"]
            and not invariants["skipped"]
            and invariants["engines_match_trainer"]
            and not invariants["quarantined"]
            and not invariants["weight_checks_over_tolerance"]
        ),
        "workdir": str(workdir),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
