"""bench/default_job_report.py: a run's guard margins are computed under the run's own stored
configuration, so a bound the run changed is the bound its margin is measured against."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench_scripts import load_bench
from vime_core.config.loader import dump_config, load_config, run_config_uri
from vime_core.report.guard import K3
from vime_core.report.records import append_record

REPO = Path(__file__).resolve().parents[2]


def _report_module():
    return load_bench("default_job_report.py", "default_job_report")


def _store_run(storage: str, run: str, k3_max: float) -> list[float]:
    cfg = load_config(None, {"storage_uri": storage, "run_name": run, "guard_k3_max": k3_max})
    dump_config(cfg, run_config_uri(storage, run))
    k3 = [0.001 * (1 + k % 3) for k in range(6)]
    for k, kl in enumerate(k3):
        append_record(
            storage,
            run,
            {"rollout_id": k, "reward_mean": 0.1 * k, "t_step": 1.0, "t_train": 0.5, "train_rollout_k3_kl": kl},
        )
    return k3


@pytest.mark.parametrize("k3_max", [0.01, 0.004])
def test_guard_margins_use_the_runs_own_bound(tmp_path, k3_max):
    storage = str(tmp_path / "runs")
    k3 = _store_run(storage, "margins", k3_max)
    summary = _report_module().summarise(storage, "margins")
    worst = summary["guard_margins"][K3]
    assert worst["limit"] == k3_max
    assert worst["value"] == pytest.approx(max(k3))
    assert worst["rollout_id"] == k3.index(max(k3))
    assert worst["ratio"] == pytest.approx(max(k3) / k3_max)
