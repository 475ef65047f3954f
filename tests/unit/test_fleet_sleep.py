"""EngineFleet's sleep levels and the room it makes for bootstrap's publish
(vime_core/engines/fleet.py): engines whose sleep drops their weights (every publish brings all of
them) sleep at level 2; before a publish of every weight beside the trainer they sleep and wake
the weights only, so their KV cache is off the device while both copies of the weights are on it.
The engines' calls are recorded here; tests/gpu runs them on vLLM's CUDA engines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vime_core.engines.fleet import EngineFleet


def _fleet(supports_sleep=True, receives_weight_updates=True, serves_adapters=False):
    calls: list[tuple] = []
    fleet = SimpleNamespace(
        supports_sleep=supports_sleep,
        receives_weight_updates=receives_weight_updates,
        serves_adapters=serves_adapters,
        health=SimpleNamespace(pause=lambda: calls.append(("health_pause",))),
        engine_memory=lambda: [],
        _each_engine=lambda method, *args: calls.append((method, *args)),
        _wake=lambda tags, indices=None: calls.append(("wake_up", *tags)),
    )
    for name in ("offload", "onload_weights", "sleep_drops_weights"):
        setattr(fleet, name, getattr(EngineFleet, name).__get__(fleet))
    return fleet, calls


def test_engines_given_every_weight_sleep_at_level_2_and_make_room_without_their_kv_cache():
    fleet, calls = _fleet()
    assert EngineFleet.room_for_publish(fleet) is True
    assert calls == [("health_pause",), ("sleep", 2, "keep"), ("wake_up", "weights")]
    calls.clear()
    fleet.offload(keep_weights=True)  # after a checkpoint: the weights they serve come back as they were
    assert calls == [("health_pause",), ("sleep", 1, "keep")]


@pytest.mark.parametrize(
    "why",
    [dict(serves_adapters=True), dict(receives_weight_updates=False), dict(supports_sleep=False)],
    ids=["adapter-publish", "no-updates", "cannot-sleep"],
)
def test_engines_that_keep_their_weights_asleep_are_left_as_they_are(why):
    fleet, calls = _fleet(**why)
    assert EngineFleet.room_for_publish(fleet) is False
    assert calls == []
    if why.get("supports_sleep", True):
        fleet.offload()  # their sleep keeps the weights on the host: a publish brings only part
        assert calls == [("health_pause",), ("sleep", 1, "keep")]
