"""`vime train --advantage-estimator ppo` on real actors: the default job (the embedded tiny model
and task) with its flags as the command line parses them, on a local Ray head with one vLLM CPU
engine behind vllm-router and one Megatron actor whose critic trains beside the policy, 2 short
iterations. Every iteration's record carries the critic's metrics and each checkpoint the
critic's file. (The critic's math, its learning and its resume are tested in-process:
tests/unit/test_value_loss.py, tests/integration/trainer/test_learning.py and test_critic.py.)"""

from __future__ import annotations

import math

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_vime_train_with_ppo_trains_and_checkpoints_the_critic(tmp_path, ray_head):
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.config import parse_args
    from vime_core.report.records import read_records
    from vime_core.trainer.checkpoint import read_manifest

    cfg = parse_args([
        "--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--value-clip", "0.5",
        "--run-name", "e2e-ppo", "--storage-uri", str(tmp_path), "--ray-address", ray_head,
        "--num-rollout", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--micro-batch-size", "8",
        "--save-interval", "1", "--vllm-server-concurrency", "64",
    ])
    assert (cfg.advantage_estimator, cfg.critic_lr, cfg.value_clip, cfg.device) == ("ppo", 1e-3, 0.5, "cpu")  # the demo's device
    try:
        train(cfg)
    finally:
        teardown(cfg.run_name)

    records = {r["rollout_id"]: r for r in read_records(str(tmp_path), cfg.run_name)}
    assert sorted(records) == [0, 1]
    for record in records.values():
        assert record["num_steps"] == 1 and math.isfinite(record["train_loss"])
        assert math.isfinite(record["value_loss"]) and 0 <= record["value_clipfrac"] <= 1
        assert record["critic_lr"] == 1e-3 and math.isfinite(record["critic_grad_norm"])
    assert records[0]["value_mean"] == 0.0  # the zero-initialised head
    manifest = read_manifest(records[1]["checkpoint"])
    assert manifest["rollout_id"] == 1 and manifest["critic_files"] == ["critic_rank_0.pt"]
