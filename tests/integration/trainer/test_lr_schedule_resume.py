"""The learning-rate schedule in the trainer (one process, TP=1, DP=1): each train call reports
the lr of its last optimizer step, the schedule's state travels in the checkpoint, and a fresh
trainer resumed from it continues the lr sequence, the optimizer step count and the weights
exactly; an old checkpoint without schedule state loads and starts at its step count."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer

LR, MIN_LR, WARMUP = 1e-3, 1e-4, 2
# 4 rollouts x 2 optimizer steps: decay over the run's 8 steps, warmup 2, cosine.
SCHEDULE = dict(num_rollout=4, lr=LR, min_lr=MIN_LR, lr_warmup_iters=WARMUP, lr_decay_style="cosine", weight_decay=0.01)


def lr_at(n: int, decay: int = 8) -> float:
    """Megatron's formula (warmup from 0, then cosine down to MIN_LR at `decay`)."""
    if n <= WARMUP:
        return LR * n / WARMUP
    r = (n - WARMUP) / (decay - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * r))


def _adam_steps(trainer) -> set[int]:
    inner = [getattr(o, "optimizer", o) for o in trainer.optimizer.chained_optimizers]
    return {int(s["step"]) for o in inner for s in o.state.values()}


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen3", True)


def test_resumed_trainer_continues_the_schedule_exactly(single_rank, ckpt, tmp_path):
    cfg = hand_config(ckpt, tmp_path, **SCHEDULE)
    first = single_rank_trainer(cfg)
    lrs = [first.train(0, hand_batch())["lr"]]
    path = first.save(0)
    for k in (1, 2, 3):
        lrs.append(first.train(k, hand_batch(scale=1.0 / (k + 1)))["lr"])
    want = {n: t.clone() for n, t in first.iter_hf_weights()}
    # rollout k's last step is optimizer step 2k + 1
    assert lrs == pytest.approx([lr_at(2 * k + 1) for k in range(4)], rel=1e-12)
    assert first.optimizer_steps == first.scheduler.num_steps == 8 and _adam_steps(first) == {8}

    second = single_rank_trainer(cfg)
    second.load(path)
    assert second.optimizer_steps == second.scheduler.num_steps == 2 and _adam_steps(second) == {2}
    resumed = [second.train(k, hand_batch(scale=1.0 / (k + 1)))["lr"] for k in (1, 2, 3)]
    assert resumed == lrs[1:]  # exactly, not approximately
    assert second.optimizer_steps == second.scheduler.num_steps == 8 and _adam_steps(second) == {8}
    for name, tensor in second.iter_hf_weights():
        assert torch.equal(tensor, want[name]), name


def test_checkpoint_without_schedule_state_starts_at_its_step_count(single_rank, ckpt, tmp_path, caplog):
    import io

    from vime_core.storage.fs import open_location
    from vime_core.trainer import checkpoint as ckpt_io

    cfg = hand_config(ckpt, tmp_path, **SCHEDULE)
    first = single_rank_trainer(cfg)
    first.train(0, hand_batch())
    first.train(1, hand_batch())
    path = first.save(1)
    next_lr = first.train(2, hand_batch())["lr"]
    # rewrite the rank file as a checkpoint written before the schedule was saved
    state = torch.load(io.BytesIO(open_location(path).get(ckpt_io.rank_file_name(0))), weights_only=False)
    del state["scheduler"]
    ckpt_io.save_rank_state(path, 0, state)

    second = single_rank_trainer(cfg)
    with caplog.at_level(logging.INFO, logger="vime_core.trainer.optimizer"):
        second.load(path)
    assert "holds no learning-rate schedule" in caplog.text and "optimizer step count, 4" in caplog.text
    assert second.scheduler.num_steps == 4
    assert second.train(2, hand_batch())["lr"] == next_lr == pytest.approx(lr_at(5))


def test_this_runs_settings_win_on_resume(single_rank, ckpt, tmp_path, caplog):
    """A checkpoint of a constant lr 1e-3 resumed with lr 2e-3: the new lr applies (Megatron's
    parameter groups carry max_lr, which loading the optimizer state must not bring back)."""
    first = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1))
    assert first.train(0, hand_batch())["lr"] == 1e-3
    path = first.save(0)
    second = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1, lr=2e-3))
    with caplog.at_level(logging.WARNING, logger="vime_core.trainer.optimizer"):
        second.load(path)
    assert "max_lr 0.001 -> 0.002" in caplog.text
    assert second.train(1, hand_batch())["lr"] == 2e-3
