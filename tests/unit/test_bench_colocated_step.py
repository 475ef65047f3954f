"""bench/gpu/bench_colocated_step.py's report, from a GPU run's files laid out as its phases leave
them: the ratios come from the stored figures, the trainer's part counts the log-prob recompute
only where the run recomputed, the rollout's own split is read from the records (not the
trainer's tokens/s), and the startup from the run's summary.json."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
step = load_bench("gpu/bench_colocated_step.py", "bench_colocated_step")


def _record(rollout_id: int, reused: bool) -> dict:
    t_save = 25.0 if rollout_id == 1 else 0.0  # a checkpoint in iteration 1: the step's median leaves it out
    return {
        "rollout_id": rollout_id,
        "t_step": 10.0 + rollout_id + t_save,
        "t_save": t_save,
        "t_rollout": 6.0,
        "t_train": 3.0,
        "output_tokens": 240_000,
        "time_generate_s": 5.0,
        "generate_tokens_per_s": 48_000.0,
        "tokens_per_s": 99_999.0,
        "reused_log_probs": reused,
        "missing_logprob_count": 0.0,
        "weight_check": {"max_abs_diff": 0.01},
    }


def _lay_out(work: Path, reused: bool) -> argparse.Namespace:
    res = work / "bench"
    (res / "train").mkdir(parents=True)
    (res / "rollout.json").write_text(
        json.dumps(
            {
                "offline": {"wall_s_median": 4.0, "tokens_per_s_median": 60_000.0, "ready_s": 50.0},
                "servers": {
                    "default": {
                        "vime": {"tokens_per_s_median": 50_000.0, "vs_offline": 50 / 60, "params": {}},
                        "logprobs+nodetok": {"tokens_per_s_median": 10_000.0, "vs_offline": 10 / 60},
                    },
                    "vllm_api_server_count=4": {
                        "vime": {"tokens_per_s_median": 54_000.0, "vs_offline": 0.9, "params": {}},
                        "logprobs+nodetok": {"tokens_per_s_median": 27_000.0, "vs_offline": 0.45},
                    },
                },
            }
        )
    )
    (res / "trainer.json").write_text(
        json.dumps(
            {
                "variants": [
                    {
                        "variant": "pack32768",
                        "step_time_s": 2.0,
                        "logprob_time_s": 1.0,
                        "mfu_with_attention": 0.4,
                        "logprob_mfu_with_attention": 0.1,
                    },
                    {
                        "variant": "pack65536",
                        "step_time_s": 1.5,
                        "logprob_time_s": 1.0,
                        "mfu_with_attention": 0.5,
                        "logprob_mfu_with_attention": 0.1,
                    },
                ]
            }
        )
    )
    (res / "train_meta.json").write_text(json.dumps({"launched_epoch": 1000.0, "exit": 0, "wall_s": 100.0}))
    # the machine's engine logs: one start from before this run (a lone server), two of this run
    (res / "train" / "engine_startup.json").write_text(
        json.dumps(
            {
                "engine-0-1-2.log": {"launched_epoch": 1010.0, "compile_cache": "hit", "marks_s": {"serving": 50.0}},
                "engine-0-9-9.log": {"launched_epoch": 900.0, "compile_cache": "miss", "marks_s": {"serving": 90.0}},
                "engine-1-1-3.log": {"launched_epoch": 1005.0, "compile_cache": "hit", "marks_s": {"serving": 52.0}},
            }
        )
    )
    records = [_record(i, reused) for i in range(4)]
    (res / "train" / "colocated_0.5b.json").write_text(json.dumps({"records": records, "batches": []}))
    (res / "peer").mkdir()
    (res / "peer" / "peer_trl_0.5b.json").write_text(
        json.dumps({"peer": "trl", "trl_version": "1.16.0", "step_s_median": 30.0, "startup_s": 70.0})
    )
    summary = work / "runs" / "reports" / "bench" / "summary.json"
    summary.parent.mkdir(parents=True)
    summary.write_text(
        json.dumps(
            {
                "startup_s": 42.5,
                "bootstrap_marks_s": {"engines_ready": 30.0},
                "startup_marks_s": {
                    "early_start": 2.0,
                    "bootstrap_started": 10.0,
                    "engines_ready": 40.0,
                    "first_iteration": 42.5,
                },
            }
        )
    )
    return argparse.Namespace(
        work=str(work), run_name="bench", prompt_tokens=512, shape="0.5b", config=step.default_config("0.5b")
    )


@pytest.mark.parametrize("reused", [True, False])
def test_the_report_reads_the_phases_files(tmp_path, monkeypatch, reused):
    monkeypatch.setattr(step, "gpu_name", lambda: "a GPU")  # no nvidia-smi, no git: a unit test starts no process
    monkeypatch.setenv("VIME_GIT_SHA", "abc1234")
    a = _lay_out(tmp_path, reused)
    out = step.phase_report(a, {"results": tmp_path / "bench"})
    t_step = 12.0  # median of 11, 12, 13 (iteration 0 left out; iteration 1's checkpoint apart)
    parts = 4.0 + 2.0 + (0.0 if reused else 1.0)
    assert out["parts_s"] == pytest.approx(parts) and out["parts_include_logprob_recompute"] is (not reused)
    assert out["ratios"]["step_vs_parts"] == pytest.approx(t_step / parts)
    assert out["ratios"]["step_vs_peer"] == pytest.approx(t_step / 30.0) and out["peer"]["trl_version"] == "1.16.0"
    assert out["ratios"]["rollout_vs_offline"] == pytest.approx((240_000 / 6.0) / 60_000.0)
    assert out["ratios"]["logprobs_cost"] == pytest.approx(10_000 / 50_000)  # the default server's
    assert out["logprobs_cost_by_server"]["vllm_api_server_count=4"] == pytest.approx(0.5)
    assert out["server_direct"]["vllm_api_server_count=4"]["vime"]["vs_offline"] == 0.9
    assert out["trainer_variants"]["pack65536"]["mfu"] == pytest.approx((0.5 * 1.5 + 0.1 * 1.0) / 2.5)
    assert out["ratios"]["trainer_mfu"] == pytest.approx((0.4 * 2.0 + 0.1 * 1.0) / 3.0)
    assert out["vime"]["generate_tokens_per_s"] == 48_000.0  # the rollout's, not the trainer's tokens_per_s
    assert out["vime"]["rollout_split_s"]["time_generate_s"] == 5.0
    assert out["git_sha"] == "abc1234" and out["machine"] == "a GPU"
    assert out["startup_s"] == 42.5 and out["bootstrap_marks_s"] == {"engines_ready": 30.0}
    assert [e["launched_epoch"] for e in out["engine_startup"]] == [1005.0, 1010.0]  # this run's, in launch order
    assert out["startup_timeline_s"] == {
        "early_start": 2.0,
        "bootstrap_started": 10.0,
        "engines_ready": 40.0,
        "first_iteration": 42.5,
    }  # the summary's, as the run wrote them


def test_startup_variants_parse_and_report_against_the_default(tmp_path):
    assert step.startup_variants(
        "default; fork:--vllm-env VLLM_WORKER_MULTIPROC_METHOD=fork;graphs:--vllm-extra-args='-O 3'"
    ) == {
        "default": [],
        "fork": ["--vllm-env", "VLLM_WORKER_MULTIPROC_METHOD=fork"],
        "graphs": ["--vllm-extra-args=-O 3"],
    }
    with pytest.raises(SystemExit, match="'a' twice"):
        step.startup_variants("a;a:--x")
    for i, (name, startup) in enumerate((("default", 80.0), ("fork", 60.0), ("broken", None))):
        folder = tmp_path / "startup" / name
        folder.mkdir(parents=True)
        summary = (
            {"startup_s": startup, "startup_marks_s": {"first_iteration": startup}, "engine_compile_cache": [name]}
            if startup
            else None
        )
        (folder / "meta.json").write_text(
            json.dumps({"exit": 0 if startup else 1, "flags": [name], "summary": summary, "ended_epoch": 1000 + i})
        )
    out = step.startup_report(tmp_path)
    assert list(out) == ["default", "fork", "broken", "by_variant"]
    assert out["fork"]["vs_default"] == pytest.approx(60.0 / 80.0) and out["default"]["vs_default"] == 1.0
    assert out["fork"]["engine_compile_cache"] == ["fork"]  # each run's own engines' answers
    assert out["broken"] == {
        "flags": ["broken"],
        "exit": 1,
        "startup_s": None,
        "engine_compile_cache": None,
        "host_caches": None,  # meta.json of a run before the bench kept them
        "startup_timeline_s": None,
        "stages_s": None,
        "vs_default": None,
    }
    assert step.startup_report(tmp_path / "nothing") is None
    for bad in ("a#2:--x", ":--x", "by_variant"):
        with pytest.raises(SystemExit, match="no variant name"):
            step.startup_variants(bad)


def _marks(launched: float, warmup: float, sleep: float) -> dict:
    """A start's marks: each stage takes `i + 1` seconds, but the warm-up and the trainer's sleep."""
    seconds = {
        "engine0_launched": launched,
        "engine0_args": 2,
        "engine0_weights_loaded": 3,
        "engine0_graphs_captured": 4,
        "engine0_engine_ready": warmup,
        "engines_ready": 6,
        "synced": 7,
        "trainer_asleep": sleep,
        "kv_onloaded": 9,
        "first_iteration": 10,
    }
    marks, t = {}, 0.0
    for mark, s in seconds.items():
        t += s
        marks[mark] = t
    return {**marks, "trainer_init": 1.0}  # beside the engine's start: no stage


def test_startup_stages_follow_the_critical_path_and_group_by_variant(tmp_path):
    warm, slow_warm, sleep, pinned_sleep = 5, 25, 8, 1
    marks = _marks(launched=1, warmup=warm, sleep=sleep)
    stages = step.startup_stages(marks)
    assert list(stages) == [name for name, _, _ in step.STARTUP_STAGES]
    assert sum(stages.values()) == pytest.approx(marks["first_iteration"])  # the stages tile the start
    assert stages["vllm_warmup"] == warm and stages["trainer_sleep"] == sleep
    assert step.startup_stages({"engines_ready": 3.0})["first_publish"] is None  # a missing mark
    # two rounds of two variants; the second round's default is slower in its warm-up only
    runs = [
        ("default", [], _marks(1, warm, sleep)),
        ("pin", ["--pin"], _marks(1, warm, pinned_sleep)),
        ("default#2", [], _marks(1, slow_warm, sleep)),
        ("pin#2", ["--pin"], _marks(1, warm, pinned_sleep)),
    ]
    for i, (name, flags, m) in enumerate(runs):
        (tmp_path / "startup" / name).mkdir(parents=True)
        (tmp_path / "startup" / name / "meta.json").write_text(
            json.dumps(
                {
                    "exit": 0,
                    "flags": flags,
                    "ended_epoch": i,
                    "summary": {"startup_s": m["first_iteration"], "startup_marks_s": m},
                }
            )
        )
    out = step.startup_report(tmp_path)
    groups = {g["name"]: g for g in out["by_variant"]}
    assert [g["runs"] for g in out["by_variant"]] == [["default", "default#2"], ["pin", "pin#2"]]
    default_median = statistics.median([runs[0][2]["first_iteration"], runs[2][2]["first_iteration"]])
    assert groups["default"]["startup_s_median"] == pytest.approx(default_median)
    assert groups["pin"]["vs_default"] == pytest.approx(runs[1][2]["first_iteration"] / default_median)
    assert out["default#2"]["vs_default"] == pytest.approx(runs[2][2]["first_iteration"] / default_median)
    assert groups["default"]["stages_s_median"]["vllm_warmup"] == pytest.approx(statistics.median([warm, slow_warm]))
    assert groups["pin"]["stages_s_median"]["trainer_sleep"] == pinned_sleep


def _startup_args(tmp_path, variants: str, **over) -> argparse.Namespace:
    """The startup phase's arguments: `variants`, one round, the 0.5b shape, unless `over` says."""
    shape = over.pop("shape", "0.5b")
    values = dict(
        startup_variants=variants,
        run_name="b",
        prompt_tokens=512,
        work=str(tmp_path / "work"),
        train_args=[],
        startup_repeats=1,
        startup_fresh=False,
        shape=shape,
        config=step.default_config(shape),
    )
    return argparse.Namespace(**{**values, **over})


def test_the_startup_phase_runs_one_iteration_per_variant_with_its_flags(tmp_path, monkeypatch):
    calls = []
    shapes = set()

    def fake_run(cmd, env, cwd):
        calls.append((cmd, env["RUN_NAME"], env["OUT"]))
        shapes.add((env["SHAPE"], Path(env["CONFIG"]).name))
        summary = tmp_path / "work" / "runs" / "reports" / env["RUN_NAME"] / "summary.json"
        summary.parent.mkdir(parents=True)
        summary.write_text(json.dumps({"startup_s": 70.0 + len(calls)}))
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(step.subprocess, "run", fake_run)
    a = _startup_args(
        tmp_path, "default;fork:--vllm-env VLLM_WORKER_MULTIPROC_METHOD=fork", train_args=["--use-tis"], shape="4b"
    )
    step.phase_startup(a, {"results": tmp_path / "bench"})
    assert [c[0][2:] for c in calls] == [
        ["1", "--use-tis"],
        ["1", "--use-tis", "--vllm-env", "VLLM_WORKER_MULTIPROC_METHOD=fork"],
    ]
    assert [c[0][1].endswith("bench/gpu/run_colocated_h200.sh") for c in calls] == [True, True]
    assert shapes == {("4b", "colocated_4b.yaml")}
    assert [c[1] for c in calls] == ["b-startup-default", "b-startup-fork"]
    out = step.startup_report(tmp_path / "bench")
    assert (out["default"]["startup_s"], out["fork"]["startup_s"]) == (71.0, 72.0)
    assert out["fork"]["vs_default"] == pytest.approx(72.0 / 71.0)


def test_startup_rounds_take_the_variants_in_turn():
    variants = step.startup_variants("default;fork:--f")
    assert step.startup_runs(variants, 2) == [
        ("default", []),
        ("fork", ["--f"]),
        ("default#2", []),
        ("fork#2", ["--f"]),
    ]
    assert step.startup_runs(variants, 1) == list(variants.items())


def test_sleep_and_wake_are_bytes_over_seconds_against_the_link():
    records = [
        {
            "memory": {
                "trainer_after_offload_train": [{"freed_bytes": freed}],
                "trainer_after_wake": {"woken_bytes": woken},
            },
            "t_offload_train": t_sleep,
            "t_wake_train": t_wake,
        }
        for freed, woken, t_sleep, t_wake in ((64e9, 72e9, 1.25, 1.2), (64e9, 72e9, 1.35, 1.0), (64e9, 72e9, 1.3, 1.1))
    ]
    link = {"d2h_gbps": 55.0, "h2d_gbps": 60.0}
    out = step.sleep_wake(records, link)
    sleep_rate = statistics.median([64 / t for t in (1.25, 1.35, 1.3)])
    wake_rate = statistics.median([72 / t for t in (1.2, 1.0, 1.1)])
    assert out["trainer_sleep"]["gb"] == pytest.approx(64) and out["trainer_wake"]["gb"] == pytest.approx(72)
    assert out["trainer_sleep"]["gbps"] == pytest.approx(sleep_rate)
    assert out["trainer_wake"]["vs_link"] == pytest.approx(wake_rate / 60.0)
    assert step.sleep_wake(records, None)["trainer_sleep"]["vs_link"] is None
    assert step.sleep_wake([{"memory": {}}], link)["trainer_wake"]["gbps"] is None


def test_guard_margins_are_the_worst_ratio_per_check():
    records = [
        {"rollout_id": k, "entropy": e, "reward_failure_share": f, "grad_norm": 1.0}
        for k, (e, f) in enumerate([(2.0, 0.0), (1.0, 0.05), (1.5, 0.0)])
    ]
    m = step.guard_margins(records, step.default_config("0.5b"))
    assert m["entropy-fall"]["rollout_id"] == 1 and m["entropy-fall"]["value"] == pytest.approx(0.5)
    assert m["reward-failures"]["value"] == pytest.approx(0.05) and m["reward-failures"]["rollout_id"] == 1
    assert all(v["ratio"] < 1 for v in m.values())


@pytest.mark.parametrize("status", [0, 1, 124])
def test_the_bench_exits_with_its_train_runs_status(tmp_path, monkeypatch, status):
    """A run that stopped (or ran past TRAIN_TIMEOUT) fails the bench: its row's exit says so."""
    monkeypatch.setattr(step.subprocess, "run", lambda cmd, env, cwd: argparse.Namespace(returncode=status))
    monkeypatch.setattr(step, "phase_report", lambda a, paths: {"ratios": {}})
    out = tmp_path / "result.json"
    code = step.main(["--phases", "train", "--no-host-setup", "--work", str(tmp_path / "w"), "--out", str(out)])
    assert code == status
    assert json.loads(out.read_text()) == {"ratios": {}}


def test_a_report_alone_exits_zero(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "phase_report", lambda a, paths: {"ratios": {}})
    out = tmp_path / "result.json"
    assert step.main(["--phases", "report", "--no-host-setup", "--work", str(tmp_path / "w"), "--out", str(out)]) == 0


def test_a_fresh_start_begins_with_the_hosts_compile_caches_emptied(tmp_path, monkeypatch):
    """--startup-fresh: before each run, what the last start compiled and inspected is gone."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    caches = step.host_compile_caches()
    assert caches[:3] == [tmp_path / "vllm", tmp_path / "inductor", tmp_path / "home" / ".triton" / "cache"]
    left_before_run = []

    def fake_run(cmd, env, cwd):
        left_before_run.append([c for c in caches if c.exists()])
        for cache in caches:  # what a start leaves behind
            (cache / "entry").mkdir(parents=True, exist_ok=True)
        return argparse.Namespace(returncode=0)

    for cache in caches:
        cache.mkdir(parents=True)
    monkeypatch.setattr(step.subprocess, "run", fake_run)
    a = _startup_args(tmp_path, "cold;carried:--vllm-cache-uri /tmp/store", startup_fresh=True)
    step.phase_startup(a, {"results": tmp_path / "bench"})
    assert left_before_run == [[], []]


def test_each_startup_records_what_the_hosts_caches_held_before_and_after(tmp_path, monkeypatch):
    """The compile hash a start made (a miss) or loaded (a hit: its AOT artifact's), and the Triton
    kernels it added to the engines' folder or to Triton's default one, per run in the report."""
    from vime_core.engines.vllm_cache import engine_triton_cache

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    kernels = engine_triton_cache({"VLLM_CACHE_ROOT": str(tmp_path / "vllm")})

    def fake_run(cmd, env, cwd):  # a miss: one compile hash, its AOT artifact, two kernels
        for folder in ("torch_compile_cache/abc123/rank_0_0", "torch_compile_cache/torch_aot_compile/def456"):
            (tmp_path / "vllm" / folder).mkdir(parents=True, exist_ok=True)
        for kernel in ("K1", "K2"):
            (kernels / kernel).mkdir(parents=True, exist_ok=True)
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(step.subprocess, "run", fake_run)
    step.phase_startup(_startup_args(tmp_path, "default"), {"results": tmp_path / "bench"})
    caches = step.startup_report(tmp_path / "bench")["default"]["host_caches"]
    empty = {"compile_hashes": [], "aot_hashes": [], "engine_triton_kernels": 0, "default_triton_kernels": 0}
    assert caches["before"] == empty
    made = {"compile_hashes": ["abc123"], "aot_hashes": ["def456"], "engine_triton_kernels": 2}
    assert caches["after"] == {**empty, **made}
