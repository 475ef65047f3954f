"""The learning-rate schedule: Megatron's OptimizerParamScheduler built from the configuration
(vime_core/trainer/optimizer.py), checked step by step against the formula, and its restore from
a checkpoint's state (or from an old checkpoint without one)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from vime_core.config import VimeConfig
from vime_core.trainer.optimizer import build_scheduler, current_lr, restore_scheduler


def expected_lr(n: float, lr: float, min_lr: float, warmup: float, decay: int, style: str, init: float = 0.0) -> float:
    """The schedule's formula (module docstring of vime_core/trainer/optimizer.py)."""
    if warmup > 0 and n <= warmup:
        return init + (lr - init) * n / warmup
    if style == "constant":
        return lr
    if n > decay:
        return min_lr
    r = (n - warmup) / (decay - warmup)
    c = 1 - r if style == "linear" else 0.5 * (1 + math.cos(math.pi * r))
    return min_lr + (lr - min_lr) * c


def fake_optimizer() -> SimpleNamespace:
    """Parameter groups shaped like Megatron's: one default group, one without weight decay."""
    return SimpleNamespace(
        param_groups=[{"default_config": True, "wd_mult": 1.0}, {"default_config": True, "wd_mult": 0.0}]
    )


def lrs(cfg: VimeConfig, steps: int) -> list[float]:
    """lr of optimizer steps 0 .. steps-1 (the scheduler is stepped after each)."""
    optimizer = fake_optimizer()
    scheduler = build_scheduler(cfg, optimizer)
    out = []
    for _ in range(steps):
        out.append(current_lr(optimizer))
        scheduler.step(increment=1)
    return out


def cfg_of(**fields) -> VimeConfig:
    return VimeConfig(**{"num_rollout": 20, **fields})  # 20 optimizer steps (one per rollout)


def test_default_is_the_constant_lr_without_warmup():
    cfg = VimeConfig()
    assert (cfg.lr_decay_style, cfg.lr_warmup_iters, cfg.lr_warmup_fraction, cfg.min_lr) == ("constant", 0, None, 0.0)
    assert cfg.lr_decay_iters == cfg.num_rollout * cfg.num_steps_per_rollout
    assert lrs(cfg, cfg.num_rollout + 3) == [cfg.lr] * (cfg.num_rollout + 3)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
def test_every_style_with_warmup_follows_the_formula(style):
    cfg = cfg_of(lr=1e-3, min_lr=1e-4, lr_warmup_iters=4, lr_decay_iters=16, lr_decay_style=style)
    got = lrs(cfg, 20)
    want = [expected_lr(n, 1e-3, 1e-4, 4, 16, style) for n in range(20)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got[0] == 0.0 and got[2] == pytest.approx(5e-4) and got[4] == pytest.approx(1e-3)  # warmup from 0
    if style == "constant":
        assert got[4:] == [1e-3] * 16
    else:
        assert got[16] == pytest.approx(1e-4) and got[17:] == [1e-4] * 3  # min_lr after the decay
        assert got[10] == pytest.approx(5.5e-4)  # half way through the decay, for both shapes
    if style == "cosine":
        assert got[7] == pytest.approx(1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 3 / 12)))


def test_decay_without_warmup_starts_at_lr_and_defaults_to_the_whole_run():
    cfg = cfg_of(lr=2e-3, lr_decay_style="linear")
    assert cfg.lr_decay_iters == 20
    got = lrs(cfg, 21)
    assert got[0] == 2e-3 and got[5] == pytest.approx(2e-3 * 15 / 20) and got[20] == 0.0


def test_warmup_fraction_and_init():
    cfg = cfg_of(lr=1e-3, lr_warmup_fraction=0.25, lr_warmup_init=1e-4, lr_decay_style="cosine", min_lr=1e-5)
    got = lrs(cfg, 20)  # warmup: 0.25 * 20 = 5 steps from 1e-4 up to 1e-3
    want = [expected_lr(n, 1e-3, 1e-5, 5.0, 20, "cosine", init=1e-4) for n in range(20)]
    assert got == pytest.approx(want, rel=1e-12)
    assert got[0] == pytest.approx(1e-4) and got[5] == pytest.approx(1e-3)


def test_weight_decay_skips_groups_without_it():
    optimizer = fake_optimizer()
    build_scheduler(cfg_of(weight_decay=0.1), optimizer)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


def test_restore_continues_the_schedule_exactly():
    cfg = cfg_of(lr=1e-3, min_lr=1e-4, lr_warmup_iters=3, lr_decay_style="cosine")
    first_opt = fake_optimizer()
    first = build_scheduler(cfg, first_opt)
    for _ in range(7):
        first.step(increment=1)
    saved = first.state_dict()
    resumed_opt = fake_optimizer()
    resumed = build_scheduler(cfg, resumed_opt)
    restore_scheduler(resumed, saved, optimizer_steps=7, where="ckpt")
    assert resumed.num_steps == 7
    for _ in range(5):
        assert current_lr(resumed_opt) == current_lr(first_opt)
        first.step(increment=1)
        resumed.step(increment=1)


def test_old_checkpoint_starts_the_schedule_at_its_step_count(caplog):
    cfg = cfg_of(lr_decay_style="linear")
    optimizer = fake_optimizer()
    scheduler = build_scheduler(cfg, optimizer)
    with caplog.at_level(logging.INFO, logger="vime_core.trainer.optimizer"):
        restore_scheduler(scheduler, None, optimizer_steps=5, where="runs/ckpt/rollout_000004")
    assert scheduler.num_steps == 5
    assert current_lr(optimizer) == pytest.approx(expected_lr(5, cfg.lr, 0.0, 0, 20, "linear"))
    assert "runs/ckpt/rollout_000004 holds no learning-rate schedule" in caplog.text
    assert "optimizer step count, 5" in caplog.text


def test_changed_settings_win_on_resume_and_are_logged(caplog):
    """A longer run (more rollouts) extends the decay; the step count comes from the checkpoint."""
    short = cfg_of(num_rollout=10, lr_decay_style="linear")
    scheduler = build_scheduler(short, fake_optimizer())
    scheduler.step(increment=4)
    saved = scheduler.state_dict()
    longer = cfg_of(num_rollout=40, lr_decay_style="linear")
    optimizer = fake_optimizer()
    resumed = build_scheduler(longer, optimizer)
    with caplog.at_level(logging.WARNING, logger="vime_core.trainer.optimizer"):
        restore_scheduler(resumed, saved, optimizer_steps=4, where="ckpt")
    assert resumed.num_steps == 4 and resumed.lr_decay_steps == 40
    assert current_lr(optimizer) == pytest.approx(longer.lr * 36 / 40)
    assert "lr_decay_steps 10 -> 40" in caplog.text
