"""bootstrap's trainer start (tasks/bootstrap.py): a trainer group it created, or one found alive
but never restored (an earlier attempt stopped between `init` and `restore`), gets `init` and
`restore(latest checkpoint)`; one found restored (a new driver, a retried bootstrap after the
restore) gets neither, so nothing it trained since is rolled back. The Ray actors are stubbed
here; tests/integration/trainer/test_training.py runs `restore` on a real trainer."""

from __future__ import annotations

import logging

import pytest

import tasks.bootstrap as boot
from vime_core.cluster.run_actors import RunActors
from vime_core.demo.settings import demo_config


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _Manager:
    """The RolloutManager's calls bootstrap makes, answered as a healthy one would."""

    def __init__(self):
        for name, value in {
            "engine_urls": ["http://127.0.0.1:1"],
            "check_engines": 0,
            "wake_asleep_engines": [],
            "weight_versions": [3],
            "end_sync": None,
            "onload_kv": None,
            "discard_prefetch": None,
            "load_data_source_state": None,
            "engine_startup_marks": [
                {"launched_epoch": 1.0, "marks_s": {"serving": 2.0}, "compile_cache": "hit"},
                {"launched_epoch": None, "marks_s": {}, "compile_cache": None},  # attached: not launched here
            ],
            "startup_epochs": {"engines_started": 3.0},
        }.items():
            setattr(self, name, _Remote(lambda *a, _v=value, **k: _v))


class _Trainers:
    """A trainer group of one rank that records the methods called on it."""

    def __init__(self, restored: bool):
        self.calls: list[tuple] = []
        self.restored = restored

    def call_async(self, method, *args):
        self.calls.append((method, *args))
        return [method]

    def wait(self, refs):
        return [None for _ in refs]

    def call(self, method, *args):
        self.calls.append((method, *args))
        if method == "restore":
            self.restored = True
            return [{"rollout_id": 2}]
        return [None]

    def rank0(self, method):
        assert method == "state"
        return {"restored": self.restored, "weight_version": 3, "last_trained_rollout_id": 2}


@pytest.fixture
def run(monkeypatch, tmp_path):
    cfg = demo_config(run_name="boot", storage_uri=str(tmp_path), hf_checkpoint="/models/x", offload_train=False)
    monkeypatch.setattr(boot, "ensure_ray", lambda address: None)
    monkeypatch.setattr(boot.ray, "get", lambda x: x)
    monkeypatch.setattr(boot, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr("vime_core.trainer.checkpoint.latest_checkpoint", lambda config: "/ckpt/rollout_2")

    def bootstrap(trainers, created):
        init = trainers.call_async("init", cfg.hf_checkpoint) if created else None
        actors = RunActors(_Manager(), trainers, new_manager=False, created=created, init=init, seconds=0.0)
        monkeypatch.setattr(boot, "start_actors", lambda config: actors)
        return boot.bootstrap.fn(cfg)

    return bootstrap


def test_a_created_group_is_initialised_and_restored(run):
    trainers = _Trainers(restored=False)
    out = run(trainers, created=True)
    assert trainers.calls == [("init", "/models/x"), ("restore", "/ckpt/rollout_2")]
    assert out["started_trainers"] is True and out["next_rollout_id"] == 3
    assert out["engine_compile_cache"] == ["hit"]  # the engines it launched, for the run's summary


def test_a_group_found_before_its_restore_is_restored(run):
    trainers = _Trainers(restored=False)
    out = run(trainers, created=False)
    assert trainers.calls == [("init", "/models/x"), ("restore", "/ckpt/rollout_2")]
    assert out["started_trainers"] is True


def test_a_group_found_restored_is_left_as_it_is(run):
    trainers = _Trainers(restored=True)
    out = run(trainers, created=False)
    assert trainers.calls == []
    assert out["started_trainers"] is False and out["weight_version"] == 3


def _config(device: str, colocate: bool = True, offload_rollout: bool = True):
    fields = {"offload_train": True, "offload_rollout": offload_rollout, "colocate": colocate, "device": device}
    return type("Cfg", (), fields)()


@pytest.mark.parametrize("engine_versions, publishes", [([1], False), ([0], True)], ids=["at-target", "behind"])
def test_a_sleeping_trainer_frees_its_optimizer_state_before_the_first_publish(monkeypatch, engine_versions, publishes):
    """Colocated and sleeping, the engines are awake while the trainer publishes: its optimizer
    state must leave the device first, its weights once they are sent; the engines let their KV
    cache go before the publish (room_for_publish), as at each iteration's publish."""
    calls: list[tuple] = []
    trainers = _Trainers(restored=True)
    trainers.call = lambda method, *args: calls.append((method, *args)) or [None]
    manager = _Manager()
    manager.weight_versions = _Remote(lambda: engine_versions)
    manager.room_for_publish = _Remote(lambda: calls.append(("room_for_publish",)) or True)
    monkeypatch.setattr(boot.ray, "get", lambda x: x)
    monkeypatch.setattr(boot, "submit_publish", lambda m, t, target, force: calls.append(("publish", target)) or [])
    boot.synced_at_start(_config("cuda"), manager, trainers, 1, engines_woken=False)
    assert calls == [("sleep", True), *([("room_for_publish",), ("publish", 1)] if publishes else []), ("sleep",)]
    for apart in (_config("cuda", colocate=False), _config("cuda", offload_rollout=False)):
        calls.clear()  # engines on their own devices, or never asleep: their KV cache stays
        boot.synced_at_start(apart, manager, trainers, 1, False)
        assert calls == [("sleep", True), *([("publish", 1)] if publishes else []), ("sleep",)]
    calls.clear()
    boot.synced_at_start(_config("cpu"), manager, trainers, 1, False)
    assert calls == ([("publish", 1)] if publishes else [])  # on CPU nothing sleeps
