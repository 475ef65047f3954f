"""The classes vime runs as Ray actors are threaded actors: Ray makes a class with any coroutine
method an asyncio actor, whose calls all run on one event-loop thread (sync methods block it,
and max_concurrency then counts coroutines), which silently serialises the RolloutManager's
calls (it is written for threads: its locks, max_concurrency=8 in cluster/run_actors.py)."""

from __future__ import annotations

import inspect

import pytest


def _actor_classes():
    from vime_core.engines.server import EngineServer
    from vime_core.rollout.manager import RolloutManager
    from vime_core.cluster.trainer_group import TrainerActor
    from vime_core.trainer.trainer import MegatronTrainer

    return [RolloutManager, EngineServer, TrainerActor, MegatronTrainer]


@pytest.mark.parametrize("cls", _actor_classes(), ids=lambda c: c.__name__)
def test_actor_class_has_no_coroutine_method(cls):
    coroutines = [name for name, member in inspect.getmembers(cls) if inspect.iscoroutinefunction(member)]
    assert coroutines == [], f"{cls.__name__} would become an asyncio actor through {coroutines}"
