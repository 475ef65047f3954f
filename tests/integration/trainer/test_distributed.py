"""TP=2 and DP=2 on CPU (two processes over gloo) against the single-rank run of the same data."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn, train_and_dump
from tests.integration.trainer.hand_batch import hand_batch, hand_config

# Same math, different reduction order (TP splits matmuls and the vocabulary; DP averages
# grads in the all-reduce): fp32 differences of ~1e-7 relative, grown a little by two Adam steps.
ATOL = 2e-5
# Weights after four Adam steps: where a gradient is ~0, Adam's m / (sqrt(v) + eps) amplifies
# reduction-order noise into up to a fraction of lr (1e-3) per step for that one element.
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def reference(single_rank, cache_dir, tmp_path_factory):
    """The TP=1, DP=1 run in this process: losses, HF weights, log-probs after two rollouts."""
    from vime_core.trainer.trainer import MegatronTrainer

    ckpt = tiny_checkpoint(cache_dir, "qwen3", False)
    cfg = hand_config(ckpt, tmp_path_factory.mktemp("ref"))
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    losses = [trainer.train(k, hand_batch())["loss"] for k in range(2)]
    return {
        "ckpt": ckpt,
        "losses": losses,
        "hf": {n: t.clone() for n, t in trainer.iter_hf_weights()},
        "log_probs": trainer.compute_log_probs(hand_batch()),
    }


def _run(tmp_path, tp, world, ckpt):
    spawn(train_and_dump, world, tp, str(ckpt), str(tmp_path / "storage"), str(tmp_path))
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_same_training(result, reference):
    assert result["losses"] == pytest.approx(reference["losses"], abs=ATOL)
    assert sorted(result["hf"]) == sorted(reference["hf"])
    for name, tensor in reference["hf"].items():
        torch.testing.assert_close(result["hf"][name], tensor, atol=WEIGHT_ATOL, rtol=0)
    for ours, ref in zip(result["log_probs"], reference["log_probs"]):
        assert ours == pytest.approx(ref, abs=ATOL)


@pytest.mark.slow
def test_tp2_round_trip_exact_and_same_training_as_tp1(tmp_path, reference):
    ranks = _run(tmp_path, tp=2, world=2, ckpt=reference["ckpt"])
    assert all(r["round_trip_exact"] for r in ranks)  # HF -> 2 shards -> gathered HF, bit for bit
    assert reference["losses"][1] != reference["losses"][0]  # the second rollout saw new weights
    for r in ranks:
        _assert_same_training(r, reference)
    # the two TP ranks hold different halves of the sharded parameters
    qkv = "module.decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(ranks[0]["local"][qkv], ranks[1]["local"][qkv])


@pytest.mark.slow
def test_dp2_keeps_parameters_identical_and_matches_dp1(tmp_path, reference):
    ranks = _run(tmp_path, tp=1, world=2, ckpt=reference["ckpt"])
    for name, p in ranks[0]["local"].items():
        assert torch.equal(p, ranks[1]["local"][name]), name  # replicas stay bit-identical
    for r in ranks:
        _assert_same_training(r, reference)
