"""save-k on a colocated run whose trainer sleeps: the engines sleep with their weights kept
while the trainer wakes whole to save, and wake again even when the save fails (a 4b-shaped
model's optimizer state and the engines' KV cache do not fit one H200 together)."""

from __future__ import annotations

import types

import pytest

import tasks.checkpoint as checkpoint


class _Remote:
    def __init__(self, calls: list, name: str, returns=None):
        self.calls, self.name, self.returns = calls, name, returns

    def remote(self, *args, **kwargs):
        self.calls.append((self.name, kwargs))
        return self.returns


def _handles(monkeypatch, save_fails: bool = False) -> list:
    calls: list = []
    manager = types.SimpleNamespace(
        data_source_state=_Remote(calls, "data_source_state", {"cursor": 7}),
        offload=_Remote(calls, "engines_sleep"),
        onload_weights=_Remote(calls, "engines_wake_weights"),
        onload_kv=_Remote(calls, "engines_wake_kv"),
    )

    def call(method, *args):
        calls.append((f"trainer_{method}", {}))
        if save_fails:
            raise RuntimeError("disk full")
        return ["/ckpt/3"]

    monkeypatch.setattr(checkpoint, "run_handles", lambda config: (manager, types.SimpleNamespace(call=call)))
    monkeypatch.setattr(checkpoint, "ray", types.SimpleNamespace(get=lambda x: x))
    monkeypatch.setattr(checkpoint, "get_run_logger", lambda: types.SimpleNamespace(info=lambda *a: None))
    return calls


def test_engines_rest_around_the_save_with_their_weights_kept(monkeypatch):
    calls = _handles(monkeypatch)
    out = checkpoint.save_checkpoint.fn(object(), 3, engines_rest=True)
    assert out["path"] == "/ckpt/3"
    assert calls == [
        ("data_source_state", {}),
        ("engines_sleep", {"keep_weights": True}),
        ("trainer_save", {}),
        ("engines_wake_weights", {}),
        ("engines_wake_kv", {}),
    ]


def test_engines_wake_after_a_failed_save(monkeypatch):
    calls = _handles(monkeypatch, save_fails=True)
    with pytest.raises(RuntimeError, match="disk full"):
        checkpoint.save_checkpoint.fn(object(), 3, engines_rest=True)
    assert [c[0] for c in calls][-2:] == ["engines_wake_weights", "engines_wake_kv"]


def test_without_rest_the_engines_are_left_alone(monkeypatch):
    calls = _handles(monkeypatch)
    checkpoint.save_checkpoint.fn(object(), 3)
    assert [c[0] for c in calls] == ["data_source_state", "trainer_save"]
