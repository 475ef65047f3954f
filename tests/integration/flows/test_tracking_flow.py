"""The train flow with --use-wandb (offline) and --use-tensorboard on real actors, 2 iterations:
what metrics.jsonl holds is what W&B's run folder and TensorBoard's event files hold, at
step = rollout id, written from inside the report tasks of real iteration flow runs."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SECRET = "wandb-key-that-must-not-be-written-9876543210"
# credentials in configuration fields: W&B's config and TensorBoard get the redacted configuration
FIELD_CANARIES = ("rm-pw-canary-41c7", "rm-key-canary-88e2", "hf-token-canary-05aa")


def test_train_flow_tracks_every_iteration(tmp_path, monkeypatch, ray_head, tiny_model_dir):
    from flows.train import train
    from tests.unit.test_tracking import _tensorboard, _wandb_runs
    from vime_core.cluster.run_actors import teardown
    from vime_core.demo.settings import demo_config
    from vime_core.report.records import read_records
    from vime_core.report.tracking import scalars

    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = demo_config(
        run_name="e2e-tracking",
        storage_uri=str(tmp_path),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=2,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        micro_batch_size=8,
        vllm_server_concurrency=64,
        use_wandb=True,
        wandb_mode="offline",
        use_tensorboard=True,
        rm_url=f"https://bob:{FIELD_CANARIES[0]}@rm.invalid/score?token={FIELD_CANARIES[1]}",
        vllm_extra_args=["--hf-token", FIELD_CANARIES[2]],
    )
    try:
        train(cfg)
    finally:
        teardown(cfg.run_name)

    folder = tmp_path / "reports" / cfg.run_name
    expected = {r["rollout_id"]: scalars(r) for r in read_records(str(tmp_path), cfg.run_name)}
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
        for p in tmp_path.rglob("*")
        if p.is_file()
        for s in (SECRET, *FIELD_CANARIES)
        if s.encode() in p.read_bytes()
    ]
    assert leaked == []
