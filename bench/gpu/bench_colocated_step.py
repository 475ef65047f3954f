"""The colocated step on one GPU against its parts, in one command: the same model and prompts through
vLLM offline, `vime train` colocated, its startup and the trainer alone, then one JSON of the ratios.

    model    a random Qwen2-0.5B-shaped model and prompts of exactly --prompt-tokens tokens
    offline  vLLM's offline LLM.generate with the run's engine flags, then vime's server with and
             without log-probs (bench/gpu/rollout_vs_offline.py)
    train    `vime train` for --iterations iterations, colocated, both sides sleeping
    startup  one-iteration `vime train` runs per --startup-variants entry, --startup-repeats rounds
    trainer  old-log-prob recompute plus one step on the stored batches' shape (bench_trainer_gpu.py)
    link     the host link's bandwidth each way (bench/gpu/host_link.py), the bound of sleep and wake
    peer     TRL's GRPOTrainer, vLLM colocated and sleeping, on the same model, prompts, reward and
             settings (bench/gpu/run_peer_trl_h200.sh; its wheels: bench/gpu/peer_wheels.sh)
    report   the git SHA, the parts and the ratios (medians over iterations after the first):
             step_vs_parts = T_step / (offline rollout + trainer alone), rollout_vs_offline,
             logprobs_cost, trainer_mfu, startup_s, sleep/wake GB/s against the link's,
             step_vs_peer = T_step / the peer's step (medians, the first step of each left out)

Each phase can run alone (--phases); results stay under --work, so a later phase joins the report.

    python bench/gpu/bench_colocated_step.py --iterations 6 --out $OUT/colocated_step.json
    bench/run.py colocated_step --iterations 6      # the same, its JSON recorded as a row

An MoE shape (--shape moe, bench/gpu/colocated_moe.yaml) reports its MFUs on active parameters
(`mfu_basis`) and the engines' log-prob mismatch (vime.rollout_k3_kl, vime.rollout_logprob_abs_diff);
routing replay's cost and effect is a second run with the flag after `--`, in its own --work and
--run-name (the first run's results stay apart):

    bench/run.py colocated_step --shape moe --iterations 4 --phases model,offline,train,trainer,report \
        --work /tmp/vime-gpu-moe --run-name moe-replay-off
    bench/run.py colocated_step --shape moe --iterations 4 --phases model,train,report \
        --work /tmp/vime-gpu-moe-replay --run-name moe-replay-on -- --use-rollout-routing-replay"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "gpu"))
from provenance import tree_sha  # noqa: E402

CONFIGS = REPO / "bench" / "gpu"
TRAINER_SITE = "/tmp/site-trainer"
PHASES = ("model", "offline", "train", "startup", "trainer", "link", "peer", "report")


def _median(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def git_sha() -> str:
    """VIME_GIT_SHA when set (a copied tree's .git may not be the code that runs), else git's."""
    return os.environ.get("VIME_GIT_SHA") or tree_sha(REPO) or "unknown"


def phase_model(a, paths: dict) -> None:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu/build_model.py"),
            "--shape",
            a.shape,
            "--out",
            str(paths["model"]),
            "--prompts",
            str(paths["prompts"]),
            "--prompt-tokens",
            str(a.prompt_tokens),
        ],
        check=True,
        cwd=REPO,
    )


def phase_offline(a, paths: dict) -> None:
    subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/gpu/rollout_vs_offline.py"),
            "--config",
            str(a.config),
            "--hf-checkpoint",
            str(paths["model"]),
            "--prompt-data",
            str(paths["prompts"]),
            "--repeats",
            str(a.repeats),
            "--variants",
            a.offline_variants,
            "--server-variants",
            a.server_variants,
            "--out",
            str(paths["results"] / "rollout.json"),
        ],
        check=True,
        cwd=REPO,
    )


def phase_train(a, paths: dict) -> None:
    out = paths["results"] / "train"
    out.mkdir(parents=True, exist_ok=True)
    env = dict(
        os.environ,
        OUT=str(out),
        PROMPT_TOKENS=str(a.prompt_tokens),
        VIME_GPU_WORK=str(a.work),
        RUN_NAME=a.run_name,
        SHAPE=a.shape,
        CONFIG=str(a.config),
    )
    launched = time.time()
    proc = subprocess.run(
        ["bash", str(REPO / "bench/gpu/run_colocated_h200.sh"), str(a.iterations), *a.train_args], env=env, cwd=REPO
    )
    (paths["results"] / "train_meta.json").write_text(
        json.dumps({"launched_epoch": launched, "exit": proc.returncode, "wall_s": time.time() - launched})
    )


def startup_variants(text: str) -> dict[str, list[str]]:
    """'default;fork:--vllm-env VLLM_WORKER_MULTIPROC_METHOD=fork' -> {name: extra vime train flags}."""
    variants: dict[str, list[str]] = {}
    for item in filter(None, (v.strip() for v in text.split(";"))):
        name, _, flags = item.partition(":")
        if name in variants:
            raise SystemExit(f"--startup-variants: {name!r} twice")
        if not name or "#" in name or name == "by_variant":
            raise SystemExit(f"--startup-variants: {name!r} is no variant name (not empty, no '#', not 'by_variant')")
        variants[name] = shlex.split(flags)
    return variants


def startup_runs(variants: dict[str, list[str]], repeats: int) -> list[tuple[str, list[str]]]:
    """(run folder, flags) in the order run: the variants in turn, `repeats` rounds, so a drift of
    the host over the call falls on every variant alike; round r > 1 names its runs `<name>#r`."""
    return [
        (name if r == 1 else f"{name}#{r}", flags) for r in range(1, repeats + 1) for name, flags in variants.items()
    ]


def default_triton_cache(environ: dict[str, str]) -> Path:
    """Triton's kernel cache for a process started with `environ`: TRITON_CACHE_DIR, else its default."""
    return Path(environ.get("TRITON_CACHE_DIR") or Path(environ.get("HOME") or Path.home()) / ".triton" / "cache")


def host_compile_caches(environ: dict[str, str] | None = None) -> list[Path]:
    """What a fresh host lacks that a start leaves behind: vLLM's cache root (compiled graphs, model
    inspection), torch inductor's and Triton's default caches, FlashInfer's and torch's JIT builds."""
    from vime_core.engines.vllm_cache import cache_root  # boundary: fsspec (its storage), on the path after host_setup

    environ = dict(os.environ if environ is None else environ)
    home = Path(environ.get("HOME") or Path.home())
    return [
        cache_root(environ),
        Path(environ.get("TORCHINDUCTOR_CACHE_DIR") or f"{tempfile.gettempdir()}/torchinductor_{getpass.getuser()}"),
        default_triton_cache(environ),
        home / ".cache" / "flashinfer",
        home / ".cache" / "torch_extensions",
    ]


def host_cache_entries(environ: dict[str, str] | None = None) -> dict:
    """What the host's caches hold, to tell what a start hit and what it made: vLLM's compile hashes
    (torch.compile's folders, and the AOT artifacts' a hit loads), and the Triton kernels in the
    engines' folder (engine_triton_cache) and in Triton's default one, a folder each."""
    from vime_core.engines.vllm_cache import cache_root, engine_triton_cache  # boundary: as host_compile_caches

    environ = dict(os.environ if environ is None else environ)
    compiled = cache_root(environ) / "torch_compile_cache"

    def folders(path: Path) -> list[str]:
        return sorted(p.name for p in path.iterdir() if p.is_dir()) if path.is_dir() else []

    return {
        "compile_hashes": [name for name in folders(compiled) if name != "torch_aot_compile"],
        "aot_hashes": folders(compiled / "torch_aot_compile"),
        "engine_triton_kernels": len(folders(engine_triton_cache(environ))),
        "default_triton_kernels": len(folders(default_triton_cache(environ))),
    }


def empty_host_caches() -> list[str]:
    """Remove `host_compile_caches()`: the next start is a fresh host's (but for the page cache and
    Python's bytecode); the folders that were there."""
    removed = [str(path) for path in host_compile_caches() if path.exists()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def phase_startup(a, paths: dict) -> None:
    """One-iteration runs, one per variant and round, in the order given, each with its own run name
    and report: on a warm host (the train phase or an earlier call filled vLLM's compile cache), or
    with --startup-fresh each after `empty_host_caches` (a fresh host's start)."""
    out = paths["results"] / "startup"
    for name, flags in startup_runs(startup_variants(a.startup_variants), a.startup_repeats):
        if a.startup_fresh:
            print(f"[bench] startup {name}: emptied {empty_host_caches()}", flush=True)
        run = f"{a.run_name}-startup-{name.replace('#', '-')}"
        env = dict(
            os.environ,
            OUT=str(out / name),
            PROMPT_TOKENS=str(a.prompt_tokens),
            VIME_GPU_WORK=str(a.work),
            RUN_NAME=run,
            SHAPE=a.shape,
            CONFIG=str(a.config),
            TRAIN_TIMEOUT=os.environ.get("TRAIN_TIMEOUT", "300"),
        )
        (out / name).mkdir(parents=True, exist_ok=True)
        print(f"[bench] startup {name}: {' '.join(flags) or '(defaults)'}", flush=True)
        caches_before = host_cache_entries()
        proc = subprocess.run(
            ["bash", str(REPO / "bench/gpu/run_colocated_h200.sh"), "1", *a.train_args, *flags], env=env, cwd=REPO
        )
        summary = Path(a.work) / "runs" / "reports" / run / "summary.json"
        (out / name / "meta.json").write_text(
            json.dumps(
                {
                    "exit": proc.returncode,
                    "flags": flags,
                    "run_name": run,
                    "ended_epoch": time.time(),
                    "summary": json.loads(summary.read_text()) if summary.exists() else None,
                    "host_caches": {"before": caches_before, "after": host_cache_entries()},
                }
            )
        )


# Where a start's seconds go, along its critical path: (stage, from mark, to mark) over the run's
# startup_marks_s (seconds since the command; None: the command itself). The engine's marks are
# the first engine's (engine0_*, vime_core/engines/startup_log.py); the trainer's own start
# (trainer_init) runs beside the engine's and is not a stage.
STARTUP_STAGES = (
    ("before_engine_launch", None, "engine0_launched"),  # imports, configuration, Ray's actors
    ("vllm_front_end_imports", "engine0_launched", "engine0_args"),
    (
        "engine_core_start_and_load",
        "engine0_args",
        "engine0_weights_loaded",
    ),  # the engine core's process, then the weights
    ("compile_kv_and_graphs", "engine0_weights_loaded", "engine0_graphs_captured"),
    ("vllm_warmup", "engine0_graphs_captured", "engine0_engine_ready"),
    ("serving_and_router", "engine0_engine_ready", "engines_ready"),
    ("first_publish", "engines_ready", "synced"),
    ("trainer_sleep", "synced", "trainer_asleep"),
    ("kv_wake", "trainer_asleep", "kv_onloaded"),
    ("to_first_iteration", "kv_onloaded", "first_iteration"),
)


def startup_stages(marks: dict | None) -> dict[str, float | None]:
    """{stage: seconds}: each STARTUP_STAGES entry's `to - from`; None where either mark is missing."""
    marks = marks or {}
    at = lambda m: 0.0 if m is None else marks.get(m)  # noqa: E731
    return {
        stage: (at(b) - at(a) if at(a) is not None and at(b) is not None else None) for stage, a, b in STARTUP_STAGES
    }


def startup_report(results: Path) -> dict | None:
    """{run: its flags, exit, startup_s, marks, stages and ratio to the default variant}, in the
    order run, and `by_variant`: per variant (its rounds `<name>#r` with it) its runs and the
    medians of startup_s and of each stage. Two variants may share flags (the same flags on a cold
    and on a seeded host, --startup-fresh); each ratio is against the median of the variant named
    `default`."""
    folder = results / "startup"
    metas = (
        [(path.parent.name, json.loads(path.read_text())) for path in folder.glob("*/meta.json")]
        if folder.exists()
        else []
    )
    if not metas:
        return None
    out: dict = {}
    for name, meta in sorted(metas, key=lambda m: m[1]["ended_epoch"]):
        summary = meta.get("summary") or {}
        marks = summary.get("startup_marks_s")
        out[name] = {
            "flags": meta["flags"],
            "exit": meta["exit"],
            "startup_s": summary.get("startup_s"),
            "engine_compile_cache": summary.get("engine_compile_cache"),  # a hit and a miss are unlike starts
            "host_caches": meta.get("host_caches"),  # which compile hash it used or made, the kernels it added
            "startup_timeline_s": marks,
            "stages_s": startup_stages(marks) if marks else None,
        }
    groups: dict[str, dict] = {}
    for name, v in out.items():
        variant = name.split("#", 1)[0]
        groups.setdefault(variant, {"name": variant, "flags": v["flags"], "runs": []})["runs"].append(name)
    by_variant = []
    for g in groups.values():
        runs = [out[n] for n in g["runs"]]
        by_variant.append(
            {
                **g,
                "startup_s_median": _median([r["startup_s"] for r in runs]),
                "stages_s_median": {
                    stage: _median([(r["stages_s"] or {}).get(stage) for r in runs]) for stage, _, _ in STARTUP_STAGES
                },
            }
        )
    base = next((g["startup_s_median"] for g in by_variant if g["name"] == "default"), None)
    vs_default = lambda s: s / base if base and s else None  # noqa: E731
    for v in out.values():
        v["vs_default"] = vs_default(v["startup_s"])
    for g in by_variant:
        g["vs_default"] = vs_default(g["startup_s_median"])
    return {**out, "by_variant": by_variant}


def phase_trainer(a, paths: dict) -> None:
    from colocated_baselines import trainer_alone  # boundary: the trainer's site, on the path after host_setup
    from vime_core.config.loader import load_config

    report = json.loads((paths["results"] / "train" / f"colocated_{a.shape}.json").read_text())
    shape = batch_shape(report)
    cfg = load_config(a.config)
    extra = tuple(v for v in a.trainer_variants.split(",") if v)
    trainer_alone(
        shape["samples"],
        shape["prompt_len"],
        shape["response_len"],
        cfg,
        paths["results"] / "trainer.json",
        extra,
        model_shape=a.shape,
    )


def phase_link(a, paths: dict) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "bench/gpu/host_link.py"), "--out", str(paths["results"] / "link.json")],
        check=True,
        cwd=REPO,
    )


def phase_peer(a, paths: dict) -> None:
    env = dict(
        os.environ,
        OUT=str(paths["results"] / "peer"),
        SHAPE=a.shape,
        CONFIG=str(a.config),
        PROMPT_TOKENS=str(a.prompt_tokens),
        VIME_GPU_WORK=str(a.work),
    )
    subprocess.run(["bash", str(REPO / "bench/gpu/run_peer_trl_h200.sh"), str(a.iterations)], env=env, cwd=REPO)


def sleep_wake(records: list[dict], link: dict | None) -> dict:
    """The trainer's sleep and wake as bytes over seconds (medians over `records`), from each
    record's `memory` (offload_train's freed_bytes, the wake's woken_bytes) and phase times; with the
    link's bandwidth (phase_link), each as a share of it. The engines' sleep copies nothing over
    the link (level 2 drops the weights a publish replaces and the KV cache); their device bytes
    before and after are the record's engines_after_* rows."""

    def rank0(row):
        return (row[0] if isinstance(row, list) else row) if row else {}

    def gbps(bytes_key: str, mem_key: str, time_key: str) -> tuple[float | None, float | None]:
        pairs = [(rank0((r.get("memory") or {}).get(mem_key)).get(bytes_key), r.get(time_key)) for r in records]
        pairs = [(b, t) for b, t in pairs if b and t]
        if not pairs:
            return None, None
        return _median([b / 1e9 for b, _ in pairs]), _median([b / t / 1e9 for b, t in pairs])

    out: dict = {}
    for name, bytes_key, mem_key, time_key, link_key in (
        ("trainer_sleep", "freed_bytes", "trainer_after_offload_train", "t_offload_train", "d2h_gbps"),
        ("trainer_wake", "woken_bytes", "trainer_after_wake", "t_wake_train", "h2d_gbps"),
    ):
        gb, rate = gbps(bytes_key, mem_key, time_key)
        bound = (link or {}).get(link_key)
        out[name] = {"gb": gb, "gbps": rate, "link_gbps": bound, "vs_link": rate / bound if rate and bound else None}
    return out


def guard_margins(records: list[dict], config: Path) -> dict:
    """Per run-guard check, the worst value the run's records came to against its default bound
    (vime_core/report/guard.py `margins`; ratio 1 would have fired): the defaults must never fire
    on this bench (issue 45)."""
    from vime_core.config.loader import load_config  # boundary: the trainer's site, on the path after host_setup
    from vime_core.report.guard import GuardSettings, margins

    return margins(records, GuardSettings.of(load_config(config)))


def batch_shape(report: dict) -> dict:
    """Samples and mean prompt / response lengths of the run's stored batches."""
    batches = report["batches"]
    return {
        "samples": int(_median([b["rows"] for b in batches])),
        "prompt_len": int(round(_median([b["mean_prompt_length"] for b in batches]))),
        "response_len": int(round(_median([b["mean_response_length"] for b in batches]))),
    }


def run_summary(a, paths: dict) -> dict | None:
    """The run's summary.json (vime train writes startup_s, the command to its first iteration,
    and bootstrap's marks there)."""
    path = Path(a.work) / "runs" / "reports" / a.run_name / "summary.json"
    return json.loads(path.read_text()) if path.exists() else None


def run_config(a) -> dict | None:
    """The run's resolved configuration (vime train stores it as reports/<run>/config.json)."""
    path = Path(a.work) / "runs" / "reports" / a.run_name / "config.json"
    return json.loads(path.read_text()) if path.exists() else None


def model_counts(shape: str) -> dict:
    """The shape's parameter counts and which of them its MFUs count (bench/gpu_common.py's
    docstring: an MoE shape's on its active parameters, router and LM head included)."""
    import gpu_common  # boundary: torch, on the path only after host_setup

    if not gpu_common.is_shape(shape):
        return {}
    cfg = gpu_common.hf_config(shape)
    return {"params": gpu_common.parameter_counts(cfg), "mfu_basis": gpu_common.mfu_basis(cfg)}


def run_train_mfu(shape: str, run: dict, recs: list[dict]) -> dict:
    """The run's own trainer MFU, dense term only (6N per token, N as `model_counts`), over t_train:
    each iteration's stored batch (rows x mean prompt + response length) through a step (3 passes)
    plus the old-log-prob recompute (1 pass) where the run did not reuse the step's log-probs."""
    import gpu_common  # boundary: torch, on the path only after host_setup

    if not gpu_common.is_shape(shape):
        return {}
    cfg = gpu_common.hf_config(shape)
    batches = {b["rollout_id"]: b for b in run.get("batches", [])}
    mfus = []
    for r in recs:
        b = batches.get(r.get("rollout_id"))
        if not (b and r.get("t_train")):
            continue
        tokens = b["rows"] * (b["mean_prompt_length"] + b["mean_response_length"])
        passes = 3 + (0 if r.get("reused_log_probs") else 1)
        mfus.append(gpu_common.mfu(gpu_common.step_flops(cfg, [tokens], passes=passes)["dense"], r["t_train"]))
    return {"train_mfu_6N": _median(mfus)} if mfus else {}


def run_engine_starts(logs: dict | None, launched_epoch: float) -> list[dict]:
    """The engine starts of the `vime train` launched at `launched_epoch` (the engine logs of the
    machine may hold earlier ones), from run_colocated_h200.sh's engine_startup.json."""
    starts = [m for m in (logs or {}).values() if (m.get("launched_epoch") or 0) >= launched_epoch]
    return sorted(starts, key=lambda m: m["launched_epoch"])


def trainer_mfu(variant: dict) -> float:
    """Log-prob recompute (forward) and step (forward + backward) together: their FLOPs over their
    seconds, i.e. the two MFUs (attention counted) weighted by time."""
    step_s, lp_s = variant["step_time_s"], variant["logprob_time_s"]
    return (variant["mfu_with_attention"] * step_s + variant["logprob_mfu_with_attention"] * lp_s) / (step_s + lp_s)


def logprobs_cost(server: dict) -> float | None:
    """Tokens/s with the sampled tokens' log-probs over without, both as a run sends them: the
    `logprobs+nodetok` shape (or `logprobs`) against `vime` (or `nologprobs`)."""
    with_lp = server.get("logprobs+nodetok") or server.get("logprobs")
    without = (
        server.get("vime") if "logprobs" not in (server.get("vime") or {}).get("params", {"logprobs": 0}) else None
    )
    without = without or server.get("nologprobs")
    if not (with_lp and without):
        return None
    return with_lp["tokens_per_s_median"] / without["tokens_per_s_median"]


def phase_report(a, paths: dict) -> dict:
    res = paths["results"]
    read = lambda name: json.loads((res / name).read_text()) if (res / name).exists() else None  # noqa: E731
    rollout, trainer, meta = read("rollout.json"), read("trainer.json"), read("train_meta.json")
    link = read("link.json")
    peer = read(f"peer/peer_trl_{a.shape}.json")
    run = read(f"train/colocated_{a.shape}.json")
    out: dict = {
        "bench": "colocated_step",
        "git_sha": git_sha(),
        "date": dt.date.today().isoformat(),
        "machine": gpu_name(),
        "shape": a.shape,
        "prompt_tokens": a.prompt_tokens,
        "config": str(Path(a.config).resolve().relative_to(REPO)),
    }
    out.update(model_counts(a.shape))
    ratios: dict = {}
    if rollout:
        offline = rollout.get("offline") or {}
        out["offline_rollout"] = {
            "wall_s": offline.get("wall_s_median"),
            "tokens_per_s": offline.get("tokens_per_s_median"),
            "ready_s": offline.get("ready_s"),
        }
        servers = rollout.get("servers") or {"default": rollout["server"]}
        # per server configuration: each request shape's tokens/s and its ratio to offline
        out["server_direct"] = {
            name: {
                v: {"tokens_per_s": s["tokens_per_s_median"], "vs_offline": s["vs_offline"]}
                for v, s in server.items()
                if isinstance(s, dict) and "tokens_per_s_median" in s
            }
            for name, server in servers.items()
        }
        costs = {name: cost for name, server in servers.items() if (cost := logprobs_cost(server)) is not None}
        if costs:
            ratios["logprobs_cost"] = costs.get("default", next(iter(costs.values())))
            out["logprobs_cost_by_server"] = costs
    if run:
        from vime_core.report.records import recurring_step_s  # boundary: fsspec, on the path after host_setup

        recs = [r for r in run.get("records", []) if r.get("rollout_id", 0) >= 1] or run.get("records", [])
        vime = {
            "iterations": len(run.get("records", [])),
            # the step every iteration pays: the last iteration's checkpoint (t_save) apart
            "t_step_s": _median([recurring_step_s(r) for r in recs]),
            "phases_s": {
                k: _median([r.get(k) for r in recs])
                for k in (
                    "t_rollout",
                    "t_train",
                    "t_sync",
                    "t_onload",
                    "t_offload_rollout",
                    "t_offload_train",
                    "t_persist",
                    "t_eval",
                    "t_save",
                )
            },
            "rollout_tokens_per_s": _median([r["output_tokens"] / r["t_rollout"] for r in recs if r.get("t_rollout")]),
            # inside t_rollout: the rollout loop's generation (first request to the last kept
            # group), its reward calls, and the batch's build (vime_core/rollout/loop.py)
            "rollout_split_s": {
                k: _median([r.get(k) for r in recs])
                for k in (
                    "time_generate_s",
                    "time_reward_s",
                    "time_abort_s",
                    "time_finalize_s",
                    "time_total_s",
                    "t_build",
                )
            },
            "generate_tokens_per_s": _median([r.get("generate_tokens_per_s") for r in recs]),
            "missing_logprob_count": _median([r.get("missing_logprob_count") for r in recs]),
            # with --get-mismatch-metrics / --use-tis: the engines' log-probs against the trainer's
            "rollout_logprob_abs_diff": _median([r.get("train_rollout_logprob_abs_diff") for r in recs]),
            "rollout_logprob_abs_diff_max": max(
                (r.get("train_rollout_logprob_abs_diff") or 0.0 for r in recs), default=None
            ),
            "rollout_k3_kl": _median([r.get("train_rollout_k3_kl") for r in recs]),
            "rollout_k3_kl_max": max((r.get("train_rollout_k3_kl") or 0.0 for r in recs), default=None),
            # routing replay: the share of the engine's experts the trainer's routers would have chosen
            "routing_replay_expert_agreement": _median([r.get("routing_replay_expert_agreement") for r in recs]),
            "tis_weight": _median([r.get("tis_weight") for r in recs]),
            "weight_check_max": max((r.get("weight_check") or {}).get("max_abs_diff", 0.0) for r in recs)
            if recs
            else None,
        }
        out["vime"] = vime
        if run_cfg := run_config(a):
            vime["use_rollout_routing_replay"] = run_cfg.get("use_rollout_routing_replay")
        vime.update(run_train_mfu(a.shape, run, recs))
        out["sleep_wake"] = sleep_wake(recs, link)
        out["guard_margins"] = guard_margins(run.get("records", []), a.config)
        if meta:
            out["vime"]["exit"] = meta["exit"]
        if summary := run_summary(a, paths):
            out["startup_s"] = summary.get("startup_s")
            out["bootstrap_marks_s"] = summary.get("bootstrap_marks_s")
            out["startup_timeline_s"] = summary.get(
                "startup_marks_s"
            )  # the run's and its engines' marks since the command
        if meta and (engines := run_engine_starts(read("train/engine_startup.json"), meta["launched_epoch"])):
            out["engine_startup"] = engines
        if rollout and out["offline_rollout"]["tokens_per_s"] and vime["rollout_tokens_per_s"]:
            ratios["rollout_vs_offline"] = vime["rollout_tokens_per_s"] / out["offline_rollout"]["tokens_per_s"]
    if startups := startup_report(res):
        out["startup_variants"] = startups
    if trainer:
        variant = next(v for v in trainer["variants"] if "step_time_s" in v)
        out["trainer_alone"] = {
            k: variant.get(k) for k in variant if k.endswith(("_s", "mfu", "tokens_per_s")) or "mfu" in k
        }
        ratios["trainer_mfu"] = trainer_mfu(variant)
        # the --trainer-variants measured beside the run's packing, each with its MFU
        out["trainer_variants"] = {
            v["variant"]: {
                "step_time_s": v["step_time_s"],
                "logprob_time_s": v["logprob_time_s"],
                "mfu": trainer_mfu(v),
                "peak_memory_gib": v.get("peak_memory_gib"),
            }
            for v in trainer["variants"]
            if "step_time_s" in v
        }
    if run and rollout and trainer and out["offline_rollout"]["wall_s"]:
        # the trainer's part is what the run's trainer did: the old-log-prob recompute only where
        # the run did not reuse the step's own log-probs (one step per rollout reuses them)
        recomputed = not all(r.get("reused_log_probs") for r in recs)
        parts = (
            out["offline_rollout"]["wall_s"]
            + variant["step_time_s"]
            + (variant["logprob_time_s"] if recomputed else 0.0)
        )
        out["parts_include_logprob_recompute"] = recomputed
        ratios["step_vs_parts"] = out["vime"]["t_step_s"] / parts
        out["parts_s"] = parts
    if peer:
        out["peer"] = {k: peer.get(k) for k in ("peer", "trl_version", "vllm_version", "step_s_median", "startup_s")}
        if run and peer.get("step_s_median") and out["vime"]["t_step_s"]:
            ratios["step_vs_peer"] = out["vime"]["t_step_s"] / peer["step_s_median"]
    out["ratios"] = ratios
    return out


def default_config(shape: str) -> Path:
    """bench/gpu/colocated_<shape>.yaml where one exists (a shape's own memory settings), else the 0.5b one."""
    own = CONFIGS / f"colocated_{shape}.yaml"
    return own if own.exists() else CONFIGS / "colocated_0.5b.yaml"


def host_setup() -> None:
    """Every phase's packages, whatever phases run (bench/gpu/host_setup.sh), and the trainer's site
    on this process's path and its children's: each phase's script finds what it imports."""
    subprocess.run(["bash", str(REPO / "bench/gpu/host_setup.sh")], check=True, cwd=REPO)
    paths = [TRAINER_SITE, str(REPO)]
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])


def gpu_name() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--shape", default="0.5b", help="the model's shape in bench/gpu_common.SHAPES (or NAME@LAYERS)")
    p.add_argument(
        "--config",
        default=None,
        help="the run's configuration (default bench/gpu/colocated_SHAPE.yaml where one exists, else the 0.5b one)",
    )
    p.add_argument(
        "--no-host-setup",
        action="store_true",
        help="skip bench/gpu/host_setup.sh (the packages are importable already)",
    )
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--offline-variants",
        default="vime,logprobs+nodetok",
        help="offline phase: request shapes sent straight to the server (rollout_vs_offline --variants); "
        "`vime` is what a run sends without log-probs, `logprobs+nodetok` what it sends when a flag needs them",
    )
    p.add_argument(
        "--server-variants",
        default="default",
        help="offline phase: server configurations (rollout_vs_offline --server-variants), e.g. "
        "'default;vllm_api_server_count=4'",
    )
    p.add_argument(
        "--trainer-variants",
        default="",
        help="trainer phase: bench_trainer_gpu variants measured after the run's own packing, e.g. pack65536",
    )
    p.add_argument(
        "--startup-variants",
        default="default;fork:--vllm-env VLLM_WORKER_MULTIPROC_METHOD=fork;noprepin:--no-offload-train-prepin",
        help="startup phase: 'name:extra vime train flags' entries separated by ';', the baseline first",
    )
    p.add_argument(
        "--startup-repeats",
        type=int,
        default=1,
        help=(
            "startup phase: rounds over the variants (round r > 1 names its runs <name>#r); the report gives medians "
            "per flag set"
        ),
    )
    p.add_argument(
        "--startup-fresh",
        action="store_true",
        help="startup phase: empty the host's compile caches before each run (host_compile_caches)",
    )
    p.add_argument("--work", default=os.environ.get("VIME_GPU_WORK", "/tmp/vime-gpu"))
    p.add_argument("--run-name", default="bench-colocated-step")
    p.add_argument("--out", required=True)
    p.add_argument("train_args", nargs="*", help="extra `vime train` flags (after --)")
    a = p.parse_args(argv)
    a.config = Path(a.config) if a.config else default_config(a.shape)
    work = Path(a.work)
    paths = {
        "model": work / f"model-{a.shape}",
        "prompts": work / f"prompts-{a.prompt_tokens}.jsonl",
        "results": work / "bench",
    }
    paths["results"].mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    unknown = set(phases) - set(PHASES)
    if unknown:
        raise SystemExit(f"--phases: unknown {sorted(unknown)}; known: {', '.join(PHASES)}")
    if not a.no_host_setup:
        host_setup()
    for name in PHASES[:-1]:
        if name in phases:
            print(f"[bench] {name}", flush=True)
            globals()[f"phase_{name}"](a, paths)
    result = phase_report(a, paths)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return train_exit(paths) if "train" in phases else 0


def train_exit(paths: dict) -> int:
    """The train phase's run status (0, or the driver's: a run that stopped, 124 past TRAIN_TIMEOUT):
    a row whose run failed says so in its exit, not only by its missing figures."""
    meta = paths["results"] / "train_meta.json"
    status = json.loads(meta.read_text())["exit"] if meta.exists() else 1
    if status:
        print(f"[bench] the train phase's run exited {status}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
