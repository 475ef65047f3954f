"""The critic of advantage_estimator=ppo in one trainer process (TP=1, DP=1): its values start at
zero and fit the GAE returns, critic-only rollouts leave the policy alone, a checkpoint resumes
the critic (weights, Adam state, schedule) bit for bit, and critic_load builds its body from
another checkpoint of the policy's vocabulary."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer

ALL = [[0, 1, 2, 3]]  # hand_batch's samples as one micro-batch


def _critic_tensors(trainer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in trainer.critic.model.state_dict().items() if isinstance(t, torch.Tensor)}


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen3", True)


def test_critic_only_rollouts_fit_the_values_and_leave_the_policy(single_rank, ckpt, tmp_path):
    """hand_batch's rewards are +-1 at the last token; with gamma = lambd = 1 GAE's return is the
    reward at every token of a sample, whatever V_old. The zero head gives V = 0 at first: value
    loss 0.5 * mean(R^2) = 0.5 at the first step, explained variance 0. Six critic-only rollouts
    (two steps each) must halve the loss and explain a good part of the returns, while the policy
    stays as it was; the seventh trains the policy too."""
    cfg = hand_config(ckpt, tmp_path, advantage_estimator="ppo", critic_lr=1e-3, num_critic_only_steps=6)
    trainer = single_rank_trainer(cfg)
    batch = hand_batch()
    assert all(torch.equal(v, torch.zeros_like(v)) for v in trainer.critic.values(batch, ALL).values())
    policy = trainer.compute_log_probs(batch)

    history = [trainer.train(k, batch) for k in range(6)]
    first, last = history[0], history[-1]
    assert all(m["num_steps"] == 0 and "pg_loss" not in m for m in history)
    assert trainer.optimizer_steps == 0 and trainer.compute_log_probs(batch) == policy  # not one policy update
    assert first["value_mean"] == 0.0 and first["explained_variance"] == pytest.approx(0.0, abs=1e-12)
    assert last["value_loss"] < 0.6 * first["value_loss"], [m["value_loss"] for m in history]
    assert last["explained_variance"] > 0.3, [m["explained_variance"] for m in history]
    values = trainer.critic.values(batch, ALL)
    for i, reward in enumerate(batch["reward"]):  # each sample's values moved towards its return
        assert (values[i].mean() > 0) == (reward > 0), (i, values[i])

    trained = trainer.train(6, batch)
    assert trained["num_steps"] == 2 and trainer.optimizer_steps == 2 and "value_loss" in trained
    assert trainer.compute_log_probs(batch) != policy


def test_the_value_loss_of_the_first_step_is_half_the_mean_squared_return(single_rank, ckpt, tmp_path):
    cfg = hand_config(ckpt, tmp_path, advantage_estimator="ppo", num_steps_per_rollout=1)
    metrics = single_rank_trainer(cfg).train(0, hand_batch(scale=2.0))
    # V = V_old = 0: no clip, 0.5 * (0 - (+-2))^2 = 2 on every token
    assert metrics["value_loss"] == pytest.approx(2.0, abs=1e-12) and metrics["value_clipfrac"] == 0.0
    assert metrics["critic_grad_norm"] > 0 and metrics["critic_lr"] == cfg.critic_lr == cfg.lr
    assert metrics["num_steps"] == 1 and "pg_loss" in metrics


def test_the_value_loss_follows_seq_mean_token_sum_norm(single_rank, ckpt, tmp_path):
    """The critic aggregates like the policy: with seq_mean_token_sum_norm each sample's summed loss
    over loss_scale_factor, averaged (it raised at the first critic step before: no scale passed)."""
    cfg = hand_config(
        ckpt, tmp_path, advantage_estimator="ppo", num_steps_per_rollout=1, loss_agg_mode="seq_mean_token_sum_norm"
    )
    batch = hand_batch(scale=2.0)
    metrics = single_rank_trainer(cfg).train(0, batch)
    per_token = 0.5 * 2.0**2  # V = V_old = 0 against returns of +-2 on every token
    sums = [per_token * sum(mask) for mask in batch["loss_mask"]]
    assert metrics["value_loss"] == pytest.approx(sum(sums) / len(sums) / cfg.loss_scale_factor, abs=1e-12)


@pytest.mark.parametrize("critic_save", [False, True], ids=["beside", "critic_save"])
def test_resume_with_a_critic_equals_the_uninterrupted_run(single_rank, ckpt, tmp_path, critic_save):
    """Train rollout 0, save, train rollout 1 (the uninterrupted run); a fresh trainer loads the
    checkpoint and trains rollout 1: the same policy and critic weights and value metrics, bit
    for bit (the critic's Adam moments and schedule come back, or its step would differ). With
    critic_save the critic's file is there, not in the checkpoint, and the resume reads it there."""
    from pathlib import Path

    from vime_core.trainer.checkpoint import read_manifest

    saved = {"critic_save": str(tmp_path / "critics")} if critic_save else {}
    cfg = hand_config(ckpt, tmp_path, advantage_estimator="ppo", critic_lr=2e-3, critic_lr_warmup_iters=3, **saved)
    first = single_rank_trainer(cfg)
    first.train(0, hand_batch())
    path = first.save(0)
    manifest = read_manifest(path)
    assert manifest["critic_files"] == ["critic_rank_0.pt"]
    folder = tmp_path / "critics" / cfg.run_name / "rollout_000000" if critic_save else Path(path)
    assert manifest["critic_dir"] == (str(folder) if critic_save else None)
    assert (folder / "critic_rank_0.pt").is_file()
    assert (Path(path) / "critic_rank_0.pt").is_file() is not critic_save
    uninterrupted = first.train(1, hand_batch(scale=0.5))
    want_policy = {n: t.clone() for n, t in first.iter_hf_weights()}
    want_critic = _critic_tensors(first)

    second = single_rank_trainer(cfg)
    fresh_critic = _critic_tensors(second)
    second.load(path)
    assert second.critic.scheduler.num_steps == 2  # two steps of rollout 0: still in the warmup
    resumed = second.train(1, hand_batch(scale=0.5))
    for name, tensor in second.iter_hf_weights():
        assert torch.equal(tensor, want_policy[name]), name
    for name, tensor in _critic_tensors(second).items():
        assert torch.equal(tensor, want_critic[name]), name
    assert not torch.equal(fresh_critic["value_head.weight"], want_critic["value_head.weight"])
    for key in (
        "loss",
        "pg_loss",
        "value_loss",
        "value_clipfrac",
        "explained_variance",
        "critic_grad_norm",
        "critic_lr",
    ):
        assert resumed[key] == uninterrupted[key], key


def test_critic_load_builds_the_body_from_another_checkpoint(single_rank, ckpt, tmp_path):
    from vime_core.demo.model import build_tiny_model
    from vime_core.trainer.hf_convert import unwrap

    deeper = build_tiny_model(
        tmp_path / "three-layers",
        family="qwen3",
        seed=2,
        tie_word_embeddings=True,
        num_heads=4,
        num_kv_heads=2,
        num_layers=3,
    )
    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, advantage_estimator="ppo", critic_load=str(deeper)))
    assert len(unwrap(trainer.critic.model).decoder.layers) == 3 != len(unwrap(trainer.model).decoder.layers)
    assert trainer.train(0, hand_batch())["value_loss"] > 0

    other_vocab = build_tiny_model(
        tmp_path / "other-vocab",
        family="qwen3",
        seed=2,
        tie_word_embeddings=True,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=40,
    )
    with pytest.raises(ValueError, match=r"critic_load=.* has vocab_size=40"):
        single_rank_trainer(hand_config(ckpt, tmp_path, advantage_estimator="ppo", critic_load=str(other_vocab)))


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 1], ids=["tp2", "dp2"])
def test_the_critic_trains_the_same_at_tp2_and_dp2(single_rank, ckpt, tmp_path, tp):
    """Two ranks over gloo against this process's single rank: the critic's metrics and values,
    and the policy's loss, are the same whatever the layout (the advantages are whitened over the
    whole step at DP=2 too: their sums are all-reduced over the DP group)."""
    from tests.integration.trainer.dist_workers import spawn, train_ppo_and_dump

    cfg = hand_config(ckpt, tmp_path / "single", advantage_estimator="ppo", critic_lr=1e-3)
    single = single_rank_trainer(cfg)
    want = [single.train(k, hand_batch()) for k in range(3)]
    want_values = single.critic.values(hand_batch(), ALL)

    spawn(train_ppo_and_dump, 2, tp, str(ckpt), str(tmp_path / "storage"), str(tmp_path))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for ours, ref in zip(got["metrics"], want):
            for key in ("value_loss", "value_clipfrac", "value_mean", "explained_variance", "critic_grad_norm"):
                assert ours[key] == pytest.approx(ref[key], abs=2e-5), (key, ours[key], ref[key])
            assert ours["loss"] == pytest.approx(ref["loss"], abs=2e-5)
        for i, v in want_values.items():
            assert got["values"][i].tolist() == pytest.approx(v.tolist(), abs=1e-4), i
