"""MegatronTrainer's sleep states with the device moves stubbed: an export wakes the parameters
alone (the optimizer state stays on the host while the engines hold the device) and puts them
back to sleep; a full wake brings back both; a publish to an engine restarted while the trainer
sleeps releases the parameters it woke."""

from __future__ import annotations

import types

import pytest

import vime_core.trainer.trainer as trainer_module
from vime_core.trainer.trainer import MegatronTrainer


@pytest.fixture
def trainer(monkeypatch):
    moves: list[str] = []
    monkeypatch.setattr(
        trainer_module, "offload", lambda model, opt, keep_params: (moves.append("state->host"), (10, ["state"]))[1]
    )
    monkeypatch.setattr(
        trainer_module, "offload_params", lambda model: (moves.append("params->host"), (5, ["params"]))[1]
    )
    monkeypatch.setattr(trainer_module, "onload", lambda model, copies: (moves.append(f"{copies}->device"), 10)[1])
    monkeypatch.setattr(trainer_module, "onload_params", lambda copies: (moves.append(f"{copies}->device"), 5)[1])
    monkeypatch.setattr(trainer_module, "device_memory", dict)
    t = object.__new__(MegatronTrainer)
    t.model, t.optimizer, t.critic, t.ref_model, t.teacher_model = object(), object(), None, None, None
    t.device = types.SimpleNamespace(type="cuda")
    t._asleep = t._params_asleep = False
    t._offloaded, t._offloaded_params = [], []
    t.moves = moves
    return t


def test_an_export_wakes_the_parameters_alone_and_puts_them_back(trainer):
    trainer.sleep(keep_weights=False)
    assert (trainer._asleep, trainer._params_asleep) == (True, True)
    trainer.moves.clear()
    with trainer._awake(weights_only=True):
        assert (trainer._asleep, trainer._params_asleep) == (True, False)
    assert trainer.moves == ["['params']->device", "params->host"]
    assert (trainer._asleep, trainer._params_asleep) == (True, True)
    assert trainer._offloaded == ["state"] and trainer._offloaded_params == ["params"]


def test_a_full_wake_brings_back_parameters_and_state(trainer):
    trainer.sleep(keep_weights=False)
    trainer.moves.clear()
    trainer.wake()
    assert trainer.moves == ["['params']->device", "['state']->device"]
    assert (trainer._asleep, trainer._params_asleep, trainer._offloaded, trainer._offloaded_params) == (
        False,
        False,
        [],
        [],
    )


def test_a_checkpoint_of_a_trainer_asleep_with_its_weights_kept_leaves_them_kept(trainer):
    trainer.sleep(keep_weights=True)
    trainer.moves.clear()
    with trainer._awake():
        assert not trainer._asleep
    assert trainer.moves == ["['state']->device", "state->host"]
    assert (trainer._asleep, trainer._params_asleep) == (True, False)
