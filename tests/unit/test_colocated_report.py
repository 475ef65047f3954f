"""The GPU run's memory table (bench/gpu/colocated_report.memory_row): bytes per phase as GiB, the
trainer's peak of the phase when the record has one."""

from __future__ import annotations

import json

import pytest

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


def test_step_mfu_counts_lora_without_weight_gradients_and_recompute_apart(tmp_path, monkeypatch):
    """The report's step MFU, from the run's configuration, the model's config.json, the stored
    batches' lengths and each record's step_time_s: LoRA counts forward and the activations'
    gradients (2/3 of full fine-tuning's FLOPs on the same tokens), full recompute's extra forward
    is reported apart (LoRA with it counts what full fine-tuning counts without), and the steady
    median leaves the first iteration out."""
    report = load_bench("gpu/colocated_report.py", "colocated_report")
    gpu_common = load_bench("gpu_common.py", "gpu_common")
    from vime_core.report.records import CONFIG, report_location

    model = gpu_common.hf_config("tiny")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(model))
    lengths, response = [5], 2
    full = report.step_mfu(model, {}, lengths, response, 1.0)
    lora = report.step_mfu(model, {"lora_rank": 8, "recompute_granularity": "full"}, lengths, response, 1.0)
    assert (full["passes"], lora["passes"]) == (3, 2) and "with_recompute" not in full
    assert lora["mfu"] == pytest.approx(full["mfu"] * 2 / 3) and lora["with_recompute"] == pytest.approx(full["mfu"])

    run = {"hf_checkpoint": str(folder), "lora_rank": 8}
    report_location(str(tmp_path), "r").put_atomic(CONFIG, json.dumps(run).encode())
    step_s = [2.0, 1.0, 4.0]
    records = [{"rollout_id": k, "t_step": 1.0, "step_time_s": s} for k, s in enumerate(step_s)]
    monkeypatch.setattr(report, "read_records", lambda uri, name: records)
    monkeypatch.setattr(report, "BatchStore", lambda uri: _Tables())
    out = tmp_path / "r.json"
    assert report.main(["--storage-uri", str(tmp_path), "--run-name", "r", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    want = [report.step_mfu(model, run, lengths, response, s)["mfu"] for s in step_s]
    assert [m["mfu"] for m in got["step_mfu"]] == pytest.approx(want)
    assert want[1] == pytest.approx(want[0] * 2)  # twice as fast, twice the MFU
    assert got["step_mfu_median"] == pytest.approx((want[1] + want[2]) / 2)
