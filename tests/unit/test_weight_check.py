"""The weight check after a publish (vime_core/weight_sync/weight_check.compare, tasks/sync.check_weights
and the engine fleet's stale mark): the difference from the trainer is bf16 noise and only reported;
engines that scored the probe exactly as before while the trainer's log-probs moved did not receive
the publish, which fails the iteration and makes the retry publish to them again."""

from __future__ import annotations

import asyncio
import logging
import threading
from types import SimpleNamespace

import pytest

from vime_core.weight_sync.weight_check import compare

TOKENS = [5, 7, 9, 11]


def _moved(values, by):
    return [v + by for v in values]


def test_compare_reports_the_noise_and_names_the_engines_a_publish_did_not_reach():
    trainer_before, trainer = [-1.0, -2.0, -3.0], [-1.1, -2.0, -2.9]
    before = [[-1.02, -2.01, -3.0], [-1.0, -2.02, -2.99]]
    engines = [_moved(trainer, 0.01), before[1]]  # engine 1 scores as before
    out = compare(trainer, engines, before, trainer_before)
    assert out["stale_engines"] == [1] and out["changed_max"] == 0
    assert out["trainer_changed_max"] == max(abs(a - b) for a, b in zip(trainer, trainer_before))
    # noise above a step's change is no failure: every engine moved
    noisy = [_moved(trainer, 0.3), _moved(trainer, -0.3)]
    assert compare(trainer, noisy, before, trainer_before)["stale_engines"] == []
    # the trainer did not move (its steps were skipped): engines scoring as before are right
    assert compare(trainer_before, before, before, trainer_before)["stale_engines"] == []
    # the first check, or no trainer log-probs kept: no verdict
    assert "stale_engines" not in compare(trainer, engines, before)
    assert "stale_engines" not in compare(trainer, engines)


class _Engine:
    """An engine client whose prompt log-probs are `scores` (what its weights give)."""

    def __init__(self, scores):
        self.scores = scores

    async def generate(self, tokens, params, model=None):
        return {"prompt_logprobs": [None] + [{str(t): {"logprob": s}} for t, s in zip(tokens[1:], self.scores)]}


class _Handle:
    """An actor handle calling the object's methods in this process: m.remote(...) -> its result."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        return SimpleNamespace(remote=getattr(self.obj, name))


def _manager(engines, versions):
    """A RolloutManager over a real EngineFleet (its versions and stale mark) whose engines answer
    the probe with their scores and report `versions`; no servers, no admission."""
    from vime_core.engines.fleet import EngineFleet
    from vime_core.rollout.manager import RolloutManager

    cfg = SimpleNamespace(lora_rank=0, lora_publish="merged")
    fleet = EngineFleet.__new__(EngineFleet)
    fleet.cfg, fleet.clients, fleet.generator, fleet.served_model = cfg, engines, None, None
    fleet._weights_stale, fleet.loop = False, SimpleNamespace(run=asyncio.run)
    fleet._each_engine = lambda method: list(versions)
    fleet.pause_admission = fleet.resume_admission = lambda: None
    fleet.engine_urls = lambda: [f"engine-{i}" for i in range(len(engines))]
    manager = RolloutManager.__new__(RolloutManager)
    manager.cfg, manager.fleet = cfg, fleet
    manager._prefetch_lock, manager._prefetched, manager._last = threading.Lock(), None, None
    manager._last_probe, manager._last_trainer_probe = None, None
    return manager


def test_a_check_finding_stale_engines_fails_the_iteration_and_the_retry_publishes_again(monkeypatch):
    import tasks.sync as sync
    from tasks.common import retry_unless_configuration
    from vime_core.faults import INFRASTRUCTURE, classify, needs_bootstrap
    from vime_core.utils.errors import StaleEnginesError

    engines = [_Engine([-1.0, -2.0, -3.0]), _Engine([-1.01, -2.0, -3.0])]
    manager = _manager(engines, versions=[3, 3])
    monkeypatch.setattr(sync, "run_handles", lambda config: (_Handle(manager), None))
    monkeypatch.setattr(sync, "ray", SimpleNamespace(get=lambda x: x))
    monkeypatch.setattr(sync, "get_run_logger", lambda: logging.getLogger("test"))
    trainer_v2 = [-1.0, -2.0, -3.0]

    def synced(log_probs):
        return {"probe": {"tokens": TOKENS, "log_probs": log_probs}}

    first = sync.check_weights.fn(None, 2, synced(trainer_v2))  # nothing to compare with yet
    assert "stale_engines" not in first and first["max_abs_diff"] == pytest.approx(0.01)

    engines[0].scores = [-1.1, -2.0, -2.9]  # engine 0 took v3; engine 1 kept v2's weights
    with pytest.raises(StaleEnginesError, match=r"^check weights v3: engine\(s\) 1 scored the probe exactly") as err:
        sync.check_weights.fn(None, 3, synced(_moved(trainer_v2, 0.1)))
    fault = classify(err.value)
    assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True)  # the iteration runs again
    assert needs_bootstrap(err.value)  # but not the task: it would score the same weights again
    assert not retry_unless_configuration(None, None, SimpleNamespace(data=err.value))

    # until a publish ends, the engines report version 0 (bootstrap publishes the trainer's weights
    # again) and a sync publishes whatever they report
    assert manager.weight_versions() == [0, 0]
    assert manager.begin_sync(3) == ["engine-0", "engine-1"]  # though both report v3
    manager.fleet.weight_versions()  # agreeing versions served by the fleet: the mark stays
    assert manager.weight_versions() == [0, 0]
    manager.end_sync(True, None, 3)  # a publish ended
    assert manager.weight_versions() == [3, 3] and manager.begin_sync(3) is None


class _Trainers:
    """Trainer ranks whose publish raises `error` (as Ray raises a remote one), or succeeds."""

    def __init__(self, error=None):
        self.error = error

    def call_async(self, method, urls, version, *after):
        return [(urls, version)]

    def wait(self, refs):
        if self.error is not None:
            raise self.error
        return [{"version": version} for _, version in refs]


@pytest.mark.parametrize("bytes_moved", [True, False], ids=["after-a-byte", "before-any-byte"])
def test_a_publish_that_failed_after_its_first_byte_leaves_the_engines_stale(monkeypatch, bytes_moved):
    """Engines a publish half reached hold part of it under the version they report: the sync's
    retry and bootstrap publish again whatever they report, until a publish ends. One that failed
    before any byte changed nothing."""
    import tasks.sync as sync
    from vime_core.weight_sync.publish import PublishError

    manager = _manager([_Engine([]), _Engine([])], versions=[4, 4])
    monkeypatch.setattr(sync, "ray", SimpleNamespace(get=lambda x: x))
    failed = PublishError("publish v5 failed after weights reached the engines", bytes_moved=bytes_moved)
    with pytest.raises(PublishError):
        sync._publish_then_end_sync(_Handle(manager), _Trainers(failed), 5, True, None)
    if not bytes_moved:
        assert manager.weight_versions() == [4, 4] and manager.begin_sync(4) is None
        return
    assert manager.weight_versions() == [0, 0]  # bootstrap publishes
    assert manager.begin_sync(4) == ["engine-0", "engine-1"]  # though both report v4
    per_rank, _ = sync._publish_then_end_sync(_Handle(manager), _Trainers(), 4, True, None)
    assert per_rank == [{"version": 4}]
    assert manager.weight_versions() == [4, 4] and manager.begin_sync(4) is None
