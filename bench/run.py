#!/usr/bin/env python3
"""The one entry point of vime's benchmarks: run a suite, record its figures, show the latest.

`bench/run.py --list` lists the suites, `bench/run.py NAME [suite args...]` runs one and appends a
row to bench/results/<suite>.jsonl (also when SIGTERM stops it first, as a device call's limit
does: from what the suite had written, exit -15), `bench/run.py --table` regenerates
bench/results/README.md.
What each suite measures and the current figures: docs/measurements.md."""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from provenance import tree_sha  # noqa: E402

RESULTS = REPO / "bench" / "results"
LOCK = Path("/tmp/vime-integration.lock")


# ---- headlines: a suite's few figures for the table (a missing key shows the row's file) -------
def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _math(f: dict) -> str:
    b, l, a = f["build_and_schedule_256"], f["policy_loss_fwd_bwd_256x1024"], f["advantages_256x1024"]
    return (
        f"vs baseline: build {b['ratio_fixed']:.2f}x (packed {b['ratio_packed']:.2f}x), "
        f"PPO loss fwd+bwd {l['ratio']:.2f}x, GRPO advantages {a['ratio_grpo']:.2f}x"
    )


def _persist(f: dict) -> str:
    s3 = f.get("s3_seaweedfs_loopback") or {}
    return (
        f"256x1024 batch: write {f['local']['write_s']} s local, {s3.get('write_s', '-')} s S3 "
        f"({s3.get('write_ratio', '-')}x a raw write); read {f['local']['read_ratio']}x / "
        f"{s3.get('read_ratio', '-')}x a raw read"
    )


def _orchestration(f: dict) -> str:
    m, parts = f["modes"], []
    if "prefetch" in m:
        parts.append(f"overhead {_pct(m['prefetch']['median_of_runs_overhead_frac'])} of an iteration")
    if "serial" in m:
        parts.append(f"serial {_pct(m['serial']['median_of_runs_overhead_frac'])}")
    if "t_iteration_ratio_off_policy_over_tis" in f:
        parts.append(
            f"T_iteration one step off-policy / on-policy (both TIS) {f['t_iteration_ratio_off_policy_over_tis']:.2f}"
        )
    if "t_iteration_ratio_run_logs_over_none" in f:
        ratio = f["t_iteration_ratio_run_logs_over_none"]
        parts.append(f"T_iteration with the runs' logs in the UI / without {ratio:.2f}")
    return "; ".join(parts) + f", {f['iterations_per_run']} iterations x {f['repeats']}"


def _startup(f: dict) -> str:
    m = f["startup_s_median"]
    ratios = {mode: f.get(f"ratio_early_over_{mode}") for mode in m if mode != "early"}
    if "early_no_prestart" in m and ratios["early_no_prestart"] is None:  # rows before the modes were selectable
        ratios["early_no_prestart"] = f.get("ratio_prestart")
    words = {
        "bootstrap": "bootstrap start",
        "early_no_prestart": "early start without engine prestart",
        "cpu_engine_two_processes": "CPU engine as vLLM lays it out",
        "cpu_engine_core_spawned": "CPU engine core spawned",
        "early_again": "the same again (A/A)",
        "base": f"at {f.get('base_tree_sha', 'the base tree')}",
    }
    parts = [f"command -> first iteration: early start {m['early']:.1f} s"] + [
        f"{words.get(mode, mode)} {m[mode]:.1f} s (ratio {ratio:.2f})"
        for mode, ratio in ratios.items()
        if ratio is not None
    ]
    return ", ".join(parts) + f", x{f['repeats']}"


def _bf16_noise(f: dict) -> str:
    line = (
        f"{f['shape']} on the CPU, {f['response_tokens']} response tokens: mean |bf16 - fp32| log-prob "
        f"{f['mean_abs_bf16_vs_fp32']:.4f}, tolerance (2x) {f['tolerance']:.4f}"
    )
    if "ratio_gpu_run_over_tolerance" in f:
        line += f"; the H200 run's engine-vs-trainer difference / tolerance {f['ratio_gpu_run_over_tolerance']:.2f}"
    return line


def _publish(f: dict) -> str:
    parts = []
    for name, m in f["models"].items():
        shm = m.get("publish_shm_512MiB", {}).get("ratio_to_reload")
        gloo = m.get("publish_gloo_512MiB", {}).get("ratio_to_reload")
        line = f"{name} shm {shm:.2f}x" + (f", gloo {gloo:.2f}x" if gloo else "") + " the engine's reload"
        cost = m.get("checksum_cost_ratio_shm")
        parts.append(line + (f" (checksums: {cost:.2f}x unchecked)" if cost else ""))
    return "; ".join(parts)


def _rollout(f: dict) -> str:
    return (
        f"vime / vLLM direct {f['ratio_vime_vs_direct']:.2f}, / transformers {f['ratio_vime_vs_transformers']:.2f}; "
        f"framework {f['framework_s_per_256']:.3f} s per 256 samples"
    )


def _train(f: dict) -> str:
    machine = f"{f['parameters'] / 1e6:.0f}M, {f['dtype']}, {f['machine']['device']}"
    return f"vime / transformers tokens/s {f['ratio']:.2f} ({machine})"


def _faults(f: dict) -> str:
    k = f["kills"]
    return (
        f"ok {f['ok']}: {f['num_rollout']} iterations, kills engine {k['engine']} / trainer {k['trainer']} / "
        f"driver {k['driver']}, {f['wall_s']} s"
    )


def _default_job(f: dict) -> str:
    gains = " / ".join(f"{r['reward_gain']:.2f}" for r in f["runs"])
    walls = " / ".join(f"{r['iteration_wall_median_s']:.2f}" for r in f["runs"] if r.get("iteration_wall_median_s"))
    return (
        f"reward gain {gains} (target {f['target_gain']}); T_step median {f['median_t_step_s']:.2f} s; "
        f"iteration {walls} s"
    )


def _trainer_gpu(f: dict) -> str:
    if "variants" not in f:  # --compare
        return "layout comparison: " + ", ".join(f)
    lay = f["layout"]
    parts = [
        f"{v['variant']} step {v['step_time_s'] * 1e3:.0f} ms, MFU {_pct(v['mfu_with_attention'])}"
        for v in f["variants"][:3]
        if "step_time_s" in v
    ]
    return f"{f['shape']} TP{lay['tp']} DP{lay['dp']}, {f['batch']['tokens_per_step']} tokens/step: " + "; ".join(parts)


def _transport_gpu(f: dict) -> str:
    return "; ".join(
        f"{s['shape']} {s['bytes'] / 1e9:.2f} GB: publish {s['median_s']['publish_s'] * 1e3:.1f} ms, "
        f"receive {s['receive_GBps']:.0f} GB/s (D2D {s['d2d_GBps']:.0f})"
        for s in f["shapes"]
    )


def _colocated(f: dict) -> str:
    p = f["phases_median_s"]
    if not f["iterations"]:
        return "no iteration ran (the row's note and exit say why)"
    # rows before t_step_recurring: T_step with the last iteration's checkpoint in it
    step = p.get("t_step_recurring") or p["t_step"]
    periodic = "" if p.get("t_step_recurring") is None else " (eval and checkpoint apart)"
    return (
        f"{f['iterations']} iterations: T_step {step:.1f} s{periodic} = rollout {p['t_rollout']:.1f} + train "
        f"{p['t_train']:.1f} + ...; publish {p.get('publish_s', 0):.2f} s"
    )


def _import_time(f: dict) -> str:
    return "; ".join(f"{name} {min(s['wall_s']):.1f} s (first {s['wall_s'][0]:.1f})" for name, s in f["sets"].items())


def _largest_dense(f: dict) -> str:
    tried = ", ".join(f"{p['layers']}{'' if p['fits'] else ' no'}" for p in f["probes"])
    confirmed = f["confirmed"]
    params = f" ({f['confirmed_params'] / 1e9:.2f}e9 parameters)" if confirmed else ""
    alone = f["largest_trainer_alone"]
    return f"{f['base']} layers tried: {tried}; trainer alone up to {alone}; colocated: {confirmed}{params}"


def _colocated_baselines(f: dict) -> str:
    return (
        f"T_step / (direct rollout + trainer alone) {f['framework_ratio']:.2f}; rollout tok/s vs direct "
        f"{f['rollout_tps_ratio']:.2f}; publish / D2D copy {f['publish_vs_copy']:.0f}x"
    )


def _colocated_step(f: dict) -> str:
    """The figures a row has: a call may run some of the phases only."""
    r, v = f.get("ratios", {}), f.get("vime") or {}
    parts = [f"T_step {v['t_step_s']:.1f} s"] if v.get("t_step_s") else []
    for key, label, fmt in (
        ("step_vs_parts", "step / parts", "{:.2f}"),
        ("rollout_vs_offline", "rollout / offline", "{:.2f}"),
        ("logprobs_cost", "server tok/s with / without log-probs", "{:.2f}"),
    ):
        if r.get(key) is not None:
            parts.append(f"{label} {fmt.format(r[key])}")
    if r.get("trainer_mfu") is not None:
        parts.append(f"trainer MFU {_pct(r['trainer_mfu'])}")
    if f.get("startup_s") is not None:
        parts.append(f"startup {f['startup_s']:.0f} s")
    if groups := (f.get("startup_variants") or {}).get("by_variant"):
        parts.append(
            "one-iteration startups, median: "
            + ", ".join(
                f"{g['name']} "
                + (f"{g['startup_s_median']:.1f} s" if g["startup_s_median"] else "failed")
                + f" (x{len(g['runs'])})"
                for g in groups
            )
        )
    return "; ".join(parts) or "no figures"


def _rollout_vs_offline(f: dict) -> str:
    parts = [f"offline {f['offline']['tokens_per_s_median'] / 1e3:.1f}k tok/s; server / offline"]
    for server, variants in f["servers"].items():
        if "error" in variants:
            parts.append(f"{server}: failed ({variants['error'][:80]})")
            continue
        ratios = [
            f"{name} {v['vs_offline']:.2f}" for name, v in variants.items() if isinstance(v, dict) and "vs_offline" in v
        ]
        parts.append(f"{server}: {', '.join(ratios)}")
    return "; ".join(parts)


def _learning_gpu(f: dict) -> str:
    return f"reward gain {f['min_gain']:.2f} (target {f['target_gain']}); T_step median {f['median_t_step_s']:.2f} s"


# ---- the suites ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Suite:
    name: str
    script: str  # relative to the repository root; .py runs under the interpreter, .sh under bash
    what: str  # what it measures, against which baseline
    headline: Callable[[dict], str]
    gpu: bool = False
    lock: bool = False  # starts servers: hold LOCK while it runs
    out: str = "--out"  # "--out": the script takes --out FILE; else the file it writes under $OUT
    drop: tuple[str, ...] = field(default=())  # bulky keys left out of the row (kept in the raw output)
    # a row with every figure the suite can give (its calls may run some phases only): the table
    # shows the latest such row too when the latest row is not one
    full: Optional[Callable[[dict], bool]] = None


SUITES = {
    s.name: s
    for s in [
        Suite(
            "math",
            "bench/bench_math.py",
            "batch build + DP schedule, PPO loss, advantages vs plain-torch baselines",
            _math,
        ),
        Suite(
            "persist",
            "bench/bench_persist.py",
            "a batch's write/read through BatchStore vs a raw write/read, local and S3",
            _persist,
            lock=True,
        ),
        Suite(
            "publish",
            "bench/bench_publish.py",
            "publish_weights into a vLLM CPU engine (shm, disk, gloo) vs its own reload",
            _publish,
            lock=True,
        ),
        Suite(
            "rollout",
            "bench/bench_rollout.py",
            "rollout tokens/s through vime vs straight to vLLM and vs transformers",
            _rollout,
            lock=True,
        ),
        Suite("train", "bench/bench_train.py", "Megatron train step tokens/s vs a plain transformers step", _train),
        Suite(
            "orchestration",
            "bench/bench_orchestration.py",
            "the default job's time outside actor compute (Prefect, Ray, persist), prefetch vs serial; "
            "--modes tis,off_policy: --async-staleness 1 vs on-policy",
            _orchestration,
            lock=True,
            drop=("rows",),
        ),
        Suite(
            "bf16_noise",
            "bench/bench_bf16_noise.py",
            "bf16 vs fp32 sampled-token log-probs of the GPU step's model: "
            "the tolerance of the engine-vs-trainer difference",
            _bf16_noise,
        ),
        Suite(
            "startup",
            "bench/bench_startup.py",
            "`vime train` from the command to its first iteration, early start vs "
            "--no-early-start, --no-engine-prestart, other modes or another checkout (--base-tree)",
            _startup,
            lock=True,
        ),
        Suite(
            "faults",
            "bench/bench_faults.py",
            "a run under random kills of engine, trainer and driver: invariants",
            _faults,
            lock=True,
        ),
        Suite(
            "default_job",
            "bench/default_job_report.py",
            "infra/main_job.sh per seed: reward gain, T_step, overhead",
            _default_job,
            lock=True,
        ),
        Suite(
            "trainer_gpu",
            "bench/bench_trainer_gpu.py",
            "trainer step and log-prob recompute on GPUs: time, MFU, memory",
            _trainer_gpu,
            gpu=True,
            drop=("check",),
        ),
        Suite(
            "transport_gpu",
            "bench/bench_transport_gpu.py",
            "CUDA-IPC weight transport vs a D2D copy; trainer sleep/wake",
            _transport_gpu,
            gpu=True,
        ),
        Suite(
            "colocated",
            "bench/gpu/run_colocated_h200.sh",
            "`vime train` colocated on GPUs: phases, publish, memory, weight check",
            _colocated,
            gpu=True,
            out="colocated_*.json",
            drop=("records",),
        ),
        Suite(
            "colocated_baselines",
            "bench/gpu/colocated_baselines.py",
            "a live colocated run vs its rollout sent straight to its engine and the trainer alone",
            _colocated_baselines,
            gpu=True,
        ),
        Suite(
            "colocated_step",
            "bench/gpu/bench_colocated_step.py",
            "the colocated step vs its parts in one command: offline vLLM, server direct, trainer alone",
            _colocated_step,
            gpu=True,
            full=lambda f: {"step_vs_parts", "rollout_vs_offline", "trainer_mfu"} <= set(f.get("ratios") or {}),
        ),
        Suite(
            "largest_dense",
            "bench/gpu/largest_dense.py",
            "the largest dense shape full fine-tuning trains colocated on one GPU: trainer-alone bisection, then vime",
            _largest_dense,
            gpu=True,
        ),
        Suite(
            "import_time",
            "bench/gpu/import_time.py",
            "each process's imports on this host (-X importtime), first try (bytecode written) and again",
            _import_time,
            gpu=True,
        ),
        Suite(
            "rollout_vs_offline",
            "bench/gpu/rollout_vs_offline.py",
            "vime's vLLM server vs offline LLM.generate, request knobs",
            _rollout_vs_offline,
            gpu=True,
        ),
        Suite(
            "learning_gpu",
            "bench/gpu/run_learning_h200.sh",
            "the default job on a GPU, colocated and sleeping: reward gain",
            _learning_gpu,
            gpu=True,
            out="learning.json",
        ),
    ]
}


# ---- provenance ----------------------------------------------------------------------------------
def git_sha() -> tuple[str, str]:
    """(sha, where it came from): $VIME_GIT_SHA, else HEAD with -dirty when tracked files differ."""
    if os.environ.get("VIME_GIT_SHA"):
        return os.environ["VIME_GIT_SHA"], "VIME_GIT_SHA"
    sha = tree_sha(REPO)
    return (sha, "git rev-parse HEAD") if sha else ("unknown", "no git")


def machine() -> str:
    """$VIME_MACHINE, else the GPUs nvidia-smi lists and the CPU count."""
    if os.environ.get("VIME_MACHINE"):
        return os.environ["VIME_MACHINE"]
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        names = []
    names = [n.strip() for n in names if n.strip()]
    cpus = f"{os.cpu_count()} CPUs {platform.machine()}"
    return f"{len(names)} x {names[0]}, {cpus}" if names else cpus


def interpreter() -> str:
    if os.environ.get("VIME_BENCH_PYTHON"):
        return os.environ["VIME_BENCH_PYTHON"]
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


# ---- running and recording -----------------------------------------------------------------------
def command(suite: Suite, args: list[str], out_dir: Path, nproc: int) -> list[str]:
    script = str(REPO / suite.script)
    if suite.script.endswith(".sh"):
        if nproc > 1:
            raise SystemExit(f"--nproc: {suite.name} is a shell script; its GPU count is its own setting")
        cmd = ["bash", script]
    elif nproc > 1:
        cmd = [interpreter(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script]
    else:
        cmd = [interpreter(), script]
    if suite.out == "--out":  # before the suite's args: a script may take everything after `--` as its own
        cmd += ["--out", str(out_dir / "result.json")]
    return cmd + args


def result_file(suite: Suite, out_dir: Path) -> Path | None:
    if suite.out == "--out":
        path = out_dir / "result.json"
        return path if path.exists() else None
    found = sorted(out_dir.glob(suite.out))
    return found[0] if found else None


class Stopped(Exception):
    """SIGTERM reached bench/run.py while its suite ran."""


def _stop(signum, frame) -> None:
    raise Stopped(signum)


def run_until_stopped(cmd: list[str], env: dict) -> tuple[int, bool]:
    """Run the suite; (its exit status, False), or (-SIGTERM, True) when bench/run.py is sent
    SIGTERM first (a device call's limit, whose `timeout` signals the whole process group, the
    suite included): the row is then written from what the suite had written so far."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        try:
            return proc.wait(), False
        except Stopped:
            return -signal.SIGTERM, True
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_suite(suite: Suite, args: list[str], results: Path, record: bool, nproc: int, note: str = "") -> int:
    """Suites run with infra/env.sh sourced, under $VIME_BENCH_PYTHON, else .venv/bin/python, else this
    interpreter. Suites that start servers hold /tmp/vime-integration.lock (flock) while they run, so
    two of them never share the machine's cores."""
    if any(a == "--out" or a.startswith("--out=") for a in args):
        raise SystemExit("bench/run.py passes --out itself (the raw output goes under .cache/bench/)")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = REPO / ".cache" / "bench" / suite.name / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = command(suite, args, out_dir, nproc)
    sha, sha_source = git_sha()
    env = dict(
        os.environ,
        OUT=str(out_dir),
        VIME_GIT_SHA=sha,
        PYTHONPATH=os.pathsep.join([str(REPO)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])),
    )
    shell = ["bash", "-c", 'source infra/env.sh && exec "$@"', "bash", *cmd]
    print(f"[bench] {suite.name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with open(LOCK, "a") if suite.lock else open(os.devnull) as lock:
        if suite.lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(
                    f"[bench] waiting for {LOCK} (another bench, or a command under flock, holds it)",
                    file=sys.stderr,
                    flush=True,
                )
                fcntl.flock(lock, fcntl.LOCK_EX)
        t0, load0 = time.monotonic(), os.getloadavg()[0]
        rc, stopped = run_until_stopped(shell, env)
        wall = time.monotonic() - t0
    path = result_file(suite, out_dir)
    if stopped:  # a device call's limit: keep what the suite wrote, say so, and be done before SIGKILL
        note = f"{note}; " if note else ""
        note += "bench/run.py was stopped (SIGTERM) before the suite exited: the row holds what it had written"
    if path is None and {"-h", "--help"} & set(args):
        return rc
    if path is None:
        print(f"[bench] {suite.name} exited {rc} and wrote no result (raw output: {out_dir})", file=sys.stderr)
        return rc or 1
    figures = json.loads(path.read_text())
    for key in suite.drop:
        figures.pop(key, None)
    row = {
        "suite": suite.name,
        "sha": sha,
        "sha_source": sha_source,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
        "load_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "command": shlex.join(["bench/run.py", *(["--nproc", str(nproc)] if nproc > 1 else []), suite.name, *args]),
        "exit": rc,
        "wall_s": round(wall, 1),
        **({"note": note} if note else {}),
        "figures": figures,
    }
    print(f"[bench] {suite.name}: {headline(suite, figures)}  (raw output: {path})", file=sys.stderr)
    if record:
        append_row(results / f"{suite.name}.jsonl", row)
        if results == RESULTS:
            write_table(results)
        print(f"[bench] row appended to {results / (suite.name + '.jsonl')}", file=sys.stderr)
    return rc


def append_row(path: Path, row: dict) -> None:
    """Appends {"suite", "sha", "sha_source", "date", "machine", "load_1m", "command", "exit", "wall_s",
    "note", "figures"} to the suite's file: `figures` is the suite's JSON less its bulky keys
    (`Suite.drop`; the whole output stays under .cache/bench/<suite>/<time>/), `load_1m` the load
    average at the start and the end (neighbours move figures), `sha` from `git_sha`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, separators=(",", ":")) + "\n")


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def headline(suite: Suite | None, figures: dict) -> str:
    try:
        return suite.headline(figures) if suite else "(no such suite)"
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        return f"(see the row: its figures lack {exc})"


# ---- the table -----------------------------------------------------------------------------------
TABLE_HEAD = """# Benchmark results

Generated by `bench/run.py --table` from the files beside it, one per suite, one JSON row per run
(git SHA, date, machine, command, figures); do not edit it by hand. Each line is the suite's
latest row, and its latest full run too (marked) when the latest row has only some of its
figures. What the suites measure, the figures in context and the commands that made them:
[docs/measurements.md](../../docs/measurements.md). Rows migrated from earlier sessions' result
files carry the commit that added the file (`sha_source`): the measurement ran on the code just
before that commit (their `note` says where it differs).

| suite | latest figures | SHA | date | machine | rows |
|---|---|---|---|---|---|
"""


def write_table(results: Path = RESULTS) -> Path:
    lines = [TABLE_HEAD]
    for path in sorted(
        results.glob("*.jsonl"), key=lambda p: (list(SUITES).index(p.stem) if p.stem in SUITES else 99, p.stem)
    ):
        rows = read_rows(path)
        if not rows:
            continue
        suite = SUITES.get(rows[-1]["suite"])
        shown = [(rows[-1], "")]
        if suite and suite.full and not suite.full(rows[-1]["figures"]):
            if full := next((r for r in reversed(rows) if suite.full(r["figures"])), None):
                shown.append((full, " (latest full run)"))
        for row, label in shown:
            cell = headline(suite, row["figures"]).replace("|", "/")
            sha = row["sha"].split("-")[0][:9] + ("-dirty" if row["sha"].endswith("-dirty") else "")
            lines.append(
                f"| [{row['suite']}]({path.name}){label} | {cell} | `{sha}` | {row['date'][:10]} | "
                f"{row['machine']} | {len(rows)} |\n"
            )
    out = results / "README.md"
    out.write_text("".join(lines))
    return out


def list_suites() -> None:
    width = max(len(n) for n in SUITES)
    for s in SUITES.values():
        tags = ", ".join(t for t, on in (("GPU", s.gpu), ("CPU", not s.gpu), ("locks", s.lock)) if on)
        print(f"{s.name:<{width}}  {tags:<10} {s.script}\n{'':<{width}}  {s.what}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="bench/run.py", description=__doc__.split("\n\n")[0], epilog="Suites: " + ", ".join(SUITES)
    )
    p.add_argument("--list", action="store_true", help="list the suites")
    p.add_argument("--table", action="store_true", help="regenerate bench/results/README.md")
    p.add_argument("--results", type=Path, default=RESULTS, help="where the rows go (default bench/results)")
    p.add_argument("--no-record", action="store_true", help="run and print, append nothing")
    p.add_argument("--nproc", type=int, default=1, help="torch.distributed.run processes (Python suites)")
    p.add_argument("--note", default="", help="kept in the row: what differed about this run")
    p.add_argument("suite", nargs="?", help="the suite to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the suite script's own flags")
    a = p.parse_args(argv)
    if a.list:
        list_suites()
        return 0
    if a.table:
        print(write_table(a.results.resolve()))
        return 0
    if not a.suite:
        p.error("name a suite (--list shows them), or --list / --table")
    if a.suite not in SUITES:
        p.error(f"unknown suite {a.suite!r}; known: {', '.join(SUITES)}")
    return run_suite(SUITES[a.suite], a.args, a.results.resolve(), not a.no_record, a.nproc, a.note)


if __name__ == "__main__":
    raise SystemExit(main())
