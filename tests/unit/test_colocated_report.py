"""The GPU run's memory table (bench/gpu/colocated_report.memory_row): bytes per phase as GiB, the
trainer's peak of the phase when the record has one."""

from __future__ import annotations

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
