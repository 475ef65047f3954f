"""The train flow with --use-wandb (offline) and --use-tensorboard on real actors, 2 iterations:
what metrics.jsonl holds is what W&B's run folder and TensorBoard's event files hold, at
step = rollout id, written from inside the report tasks of real iteration flow runs. The run
(`dataset_run`, tests/integration/flows/conftest.py) is the one test_dataset_flow.py reads: its
prompts come from a dataset folder, which the trackers do not see."""

from __future__ import annotations

import pytest

from tests.integration.flows.conftest import FIELD_CANARIES, WANDB_SECRET

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_train_flow_tracks_every_iteration(dataset_run):
    from tests.unit.test_tracking import _tensorboard, _wandb_runs
    from vime_core.report.records import read_records
    from vime_core.report.tracking import scalars

    cfg, _, _, store = dataset_run
    folder = store / "reports" / cfg.run_name
    expected = {r["rollout_id"]: scalars(r) for r in read_records(cfg.storage_uri, cfg.run_name)}
    assert sorted(expected) == [0, 1] and "reward_mean" in expected[0] and "t_train" in expected[0]

    board = _tensorboard(folder / "tensorboard")
    assert sorted(board) == [0, 1]
    for k in (0, 1):
        assert board[k] == pytest.approx(expected[k], rel=1e-6, nan_ok=True)

    (records,) = _wandb_runs(folder)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["config"]["update"]["num_rollout"] == 2 and run["config"]["update"]["use_wandb"] is True
    history = {int(r["history"]["step"].get("num", 0)): r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [0, 1]
    for k in (0, 1):
        assert {key: v for key, v in history[k].items() if not key.startswith("_")} == pytest.approx(
            expected[k], nan_ok=True
        )
    assert any(r["type"] == "exit" for r in records)  # the last iteration finished the W&B run

    assert run["config"]["update"]["rm_url"].startswith("https://bob:<redacted>@rm.invalid/")
    leaked = [
        (p, s)
        for p in store.rglob("*")  # everything the run wrote: batches, checkpoints, reports, W&B, TensorBoard
        if p.is_file()
        for s in (WANDB_SECRET, *FIELD_CANARIES)
        if s.encode() in p.read_bytes()
    ]
    assert leaked == []
