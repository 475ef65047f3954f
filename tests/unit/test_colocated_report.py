"""The GPU run's memory table (bench/gpu/colocated_report.memory_row): bytes per phase as GiB, the
trainer's peak of the phase when the record has one."""

from __future__ import annotations

import json

from tests.bench_scripts import load_bench

GIB = 2**30


def test_memory_row_in_gib_with_the_trainer_peak_where_recorded():
    report = load_bench("gpu/colocated_report.py", "colocated_report")
    row = report.memory_row(
        {
            "engines_after_onload_kv": [{"process_bytes": 3 * GIB, "device_used_bytes": {"0": 5 * GIB}}],
            "trainer_after_train": [
                {"allocated_bytes": GIB, "reserved_bytes": 2 * GIB, "peak_allocated_bytes": 7 * GIB}
            ],
            "trainer_after_wake": [{"allocated_bytes": GIB, "reserved_bytes": GIB, "process_bytes": 4 * GIB}],
            "trainer_after_publish": None,
        }
    )
    assert row["engines_after_onload_kv"] == {"engine_process_gib": 3.0, "device_used_gib": 5.0}
    assert row["trainer_after_train"] == {
        "allocated_gib": 1.0,
        "reserved_gib": 2.0,
        "peak_allocated_gib": 7.0,
        "process_gib": None,
    }
    assert row["trainer_after_wake"]["peak_allocated_gib"] is None  # a record from before the peak was kept
    assert "trainer_after_publish" not in row


def test_the_steady_step_leaves_the_last_iterations_checkpoint_apart(tmp_path, monkeypatch, capsys):
    """Three iterations, the last saving: T_step's median would take the checkpoint's seconds in (the
    median of the two steady ones); t_step_recurring does not."""
    report = load_bench("gpu/colocated_report.py", "colocated_report")
    records = [
        {"rollout_id": k, "t_step": t, "t_rollout": 10.0, "t_train": 4.0, "t_eval": 0.0, "t_save": s}
        for k, (t, s) in enumerate([(30.0, 0.0), (16.0, 0.0), (37.0, 20.0)])
    ]
    monkeypatch.setattr(report, "read_records", lambda uri, run: records)
    monkeypatch.setattr(report, "BatchStore", lambda uri: _Tables())
    out = tmp_path / "r.json"
    assert report.main(["--storage-uri", str(tmp_path), "--run-name", "r", "--out", str(out)]) == 0
    phases = json.loads(out.read_text())["phases_median_s"]
    steady = records[1:]
    assert phases["t_step"] == (steady[0]["t_step"] + steady[1]["t_step"]) / 2
    assert phases["t_step_recurring"] == (steady[0]["t_step"] + steady[1]["t_step"] - steady[1]["t_save"]) / 2
    assert phases["t_save"] == steady[1]["t_save"] / 2


class _Tables:
    """A store whose every batch is one row: a 3-token prompt and a 2-token response."""

    def read_table(self, run, rollout_id):
        import pyarrow as pa

        return pa.table({"tokens": [[1, 2, 3, 4, 5]], "response_length": [2]})
