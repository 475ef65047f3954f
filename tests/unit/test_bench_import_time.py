"""bench/gpu/import_time.py on the CPU: `-X importtime` lines parsed into depth, module and seconds,
and a real run's JSON read by bench/run.py's headline."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.bench_scripts import load_bench

import_time = load_bench("gpu/import_time.py", "bench_import_time")


def test_importtime_lines_parse_into_depth_module_and_seconds():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import json"], capture_output=True, text=True, check=True
    )
    rows = import_time.parse_importtime(proc.stderr)
    json_row = next(r for r in rows if r[1] == "json")
    decoder = next(r for r in rows if r[1] == "json.decoder")
    assert json_row[0] == 0 and decoder[0] >= 1  # json.decoder is imported by json's own import
    assert json_row[3] >= decoder[3] >= decoder[2] >= 0  # cumulative includes what it pulled in
    summary = import_time.slowest(rows)
    assert summary["total_s"] == round(sum(r[3] for r in rows if r[0] == 0), 2)
    assert "json" in summary["cumulative"] and len(summary["self"]) <= 15


def test_a_run_writes_each_sets_tries_and_the_headline_reads_them(tmp_path, monkeypatch):
    from bench import run

    monkeypatch.setattr(import_time, "SETS", {"stdlib": ([sys.executable], "json")})
    out = tmp_path / "it.json"
    assert import_time.main(["--sets", "stdlib", "--repeats", "2", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    tries = figures["sets"]["stdlib"]["tries"]
    assert len(tries) == 2 and all(t["exit"] == 0 and t["wall_s"] > 0 for t in tries)
    assert run.headline(run.SUITES["import_time"], figures).startswith("stdlib ")
