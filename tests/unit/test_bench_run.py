"""bench/run.py, the benchmarks' entry point: every suite names a script that exists, its row
lands in the suite's file with the SHA it was given, and the generated table shows each suite's
latest row through the suite's own headline (a headline that no longer reads its suite's JSON
shows up here, not in a table nobody checks)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
run = load_bench("run.py", "bench_run")


def test_every_suite_names_a_script_that_exists():
    for suite in run.SUITES.values():
        assert (REPO / suite.script).is_file(), suite


def test_the_latest_committed_row_of_every_suite_reads_through_its_headline():
    for path in sorted((REPO / "bench" / "results").glob("*.jsonl")):
        rows = run.read_rows(path)
        assert rows and all(r["suite"] == path.stem and r["sha"] and r["date"] and r["command"] for r in rows), path
        assert not run.headline(run.SUITES[path.stem], rows[-1]["figures"]).startswith("(see the row"), path


def test_the_sha_comes_from_the_environment_when_set(monkeypatch):
    monkeypatch.setenv("VIME_GIT_SHA", "abc1234")
    assert run.git_sha() == ("abc1234", "VIME_GIT_SHA")


def test_a_row_is_appended_and_the_table_shows_the_latest(tmp_path):
    figures = json.loads((REPO / "bench" / "results" / "math.jsonl").read_text().splitlines()[0])["figures"]
    for sha in ("aaaaaaa", "bbbbbbbbbbbbbbbbbbbb-dirty"):
        run.append_row(
            tmp_path / "math.jsonl",
            {
                "suite": "math",
                "sha": sha,
                "date": "2026-12-03T00:00:00Z",
                "machine": "2 CPUs x86_64",
                "command": "bench/run.py math",
                "figures": figures,
            },
        )
    table = run.write_table(tmp_path).read_text()
    assert len(run.read_rows(tmp_path / "math.jsonl")) == 2
    line = next(l for l in table.splitlines() if l.startswith("| [math]"))
    assert "`bbbbbbbbb-dirty`" in line and "build 1.35x" in line and line.endswith("| 2 |")


def test_the_output_flag_goes_before_the_suites_own_args(tmp_path):
    cmd = run.command(run.SUITES["colocated_step"], ["--iterations", "6", "--", "--use-kl-loss"], tmp_path, 1)
    assert cmd[-6:] == ["--out", str(tmp_path / "result.json"), "--iterations", "6", "--", "--use-kl-loss"]


def test_the_table_also_shows_the_latest_full_run_when_the_latest_row_is_partial(tmp_path):
    full = {"vime": {"t_step_s": 9.5}, "ratios": {"step_vs_parts": 1.1, "rollout_vs_offline": 1.0, "trainer_mfu": 0.4}}
    partial = {
        "startup_variants": {"by_variant": [{"name": "default", "runs": ["default"], "startup_s_median": 80.0}]},
        "ratios": {},
    }
    for i, (sha, figures) in enumerate((("a000000", full), ("b000000", full), ("c000000", partial))):
        run.append_row(
            tmp_path / "colocated_step.jsonl",
            {
                "suite": "colocated_step",
                "sha": sha,
                "date": f"2026-12-0{i + 1}T00:00:00Z",
                "machine": "1 GPU",
                "command": "bench/run.py colocated_step",
                "figures": figures,
            },
        )
    lines = [l for l in run.write_table(tmp_path).read_text().splitlines() if l.startswith("| [colocated_step]")]
    assert len(lines) == 2
    assert "`c000000`" in lines[0] and "default 80.0 s (x1)" in lines[0]
    assert "(latest full run)" in lines[1] and "`b000000`" in lines[1] and "T_step 9.5 s" in lines[1]
    run.append_row(
        tmp_path / "colocated_step.jsonl",
        {
            "suite": "colocated_step",
            "sha": "d000000",
            "date": "2026-12-04T00:00:00Z",
            "machine": "1 GPU",
            "command": "bench/run.py colocated_step",
            "figures": full,
        },
    )
    assert sum(l.startswith("| [colocated_step]") for l in run.write_table(tmp_path).read_text().splitlines()) == 1


def test_a_run_stopped_by_sigterm_records_what_its_suite_had_written(tmp_path):
    """A device call's limit sends SIGTERM while a suite tears down: the row is appended all the
    same, from the suite's output so far, with exit -15 and a note that says so."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "suite.sh"  # writes its result, then "tears down" for a minute
    script.write_text('echo \'{"iterations": 2}\' > "$OUT/stopped_suite.json"\nexec sleep 60\n')
    results = tmp_path / "results"
    driver = (
        "import importlib.util, sys, pathlib\n"
        f"spec = importlib.util.spec_from_file_location('bench_run', {str(REPO / 'bench' / 'run.py')!r})\n"
        "run = importlib.util.module_from_spec(spec); sys.modules[spec.name] = run; spec.loader.exec_module(run)\n"
        f"suite = run.Suite('stopped-test', {str(script)!r}, 'test', lambda f: 'x', out='stopped_suite.json')\n"
        f"sys.exit(run.run_suite(suite, [], pathlib.Path({str(results)!r}), True, 1, note='the call'))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, start_new_session=True)
    out_root = REPO / ".cache" / "bench" / "stopped-test"
    try:
        deadline = time.monotonic() + 60
        while not list(out_root.glob("*/stopped_suite.json")):
            assert time.monotonic() < deadline and proc.poll() is None, "the suite wrote nothing"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)  # bench/run.py alone: its suite sleeps on
        assert proc.wait(timeout=20) == 256 - signal.SIGTERM  # run_suite returned -15: sys.exit(-15)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(out_root, ignore_errors=True)
    [row] = run.read_rows(results / "stopped-test.jsonl")
    assert row["exit"] == -signal.SIGTERM and row["figures"] == {"iterations": 2}
    assert row["note"].startswith("the call; ") and "stopped (SIGTERM)" in row["note"]
