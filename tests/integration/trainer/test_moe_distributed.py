"""Qwen3-MoE at TP=2 (two processes over gloo) against the single-rank run of the same data: the
experts split over TP like the dense MLP, each TP rank routing the whole sequence (no sequence
parallelism): same losses, grad norms, weights and log-probs as TP=1."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.hand_batch import hand_batch, hand_config
from tests.integration.trainer.moe_workers import train_moe_and_dump
from tests.integration.trainer.test_distributed import ATOL, WEIGHT_ATOL
from tests.moe_tiny import tiny_moe_checkpoint, tiny_moe_config

ROLLOUTS = 2  # as moe_workers.train_moe_and_dump


@pytest.fixture(scope="module")
def reference(single_rank, cache_dir, tmp_path_factory):
    """The TP=1 run in this process: losses, grad norms, HF weights, log-probs after two rollouts."""
    from vime_core.trainer.trainer import MegatronTrainer

    ckpt = tiny_moe_checkpoint(cache_dir)
    trainer = MegatronTrainer(hand_config(ckpt, tmp_path_factory.mktemp("ref")), 0, 1, "127.0.0.1", 0)
    trainer.init()
    metrics = [trainer.train(k, hand_batch()) for k in range(ROLLOUTS)]
    return {
        "ckpt": ckpt,
        "losses": [m["loss"] for m in metrics],
        "grad_norms": [m["grad_norm"] for m in metrics],
        "hf": {n: t.clone() for n, t in trainer.iter_hf_weights()},
        "log_probs": trainer.compute_log_probs(hand_batch()),
    }


@pytest.mark.slow
def test_moe_tp2_round_trip_exact_and_same_training_as_tp1(tmp_path, reference):
    spawn(train_moe_and_dump, 2, 2, str(reference["ckpt"]), str(tmp_path / "storage"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert reference["losses"][1] != reference["losses"][0]  # the second rollout saw new weights
    for r in ranks:
        assert r["round_trip_exact"]  # HF -> 2 shards -> gathered HF, bit for bit
        assert r["losses"] == pytest.approx(reference["losses"], abs=ATOL)
        # the expert gradients are not TP times too large (compat_moe.allow_full_sequence_tp)
        assert r["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
        assert sorted(r["hf"]) == sorted(reference["hf"])
        for name, tensor in reference["hf"].items():
            torch.testing.assert_close(r["hf"][name], tensor, atol=WEIGHT_ATOL, rtol=0, msg=name)
        for ours, ref in zip(r["log_probs"], reference["log_probs"]):
            assert ours == pytest.approx(ref, abs=ATOL)
    fc1 = "module.decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"
    f = tiny_moe_config()["moe_intermediate_size"]
    assert ranks[0]["local"][fc1].shape[0] == 2 * f // 2  # this rank's [gate; up] halves
    assert not torch.equal(ranks[0]["local"][fc1], ranks[1]["local"][fc1])
