"""The engine fleet starts its engines at once and waits for all of them; a failure names its
engine (vime_core/engines/fleet.py, `_start_servers`). Stand-in servers, no process."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from vime_core.engines.server import EngineStartError
from vime_core.engines.fleet import EngineFleet


class Server:
    def __init__(self, index: int, start=None) -> None:
        self.name = f"engine-{index}"
        self._start = start
        self.started = False

    def start(self) -> str:
        if self._start is not None:
            self._start()
        self.started = True
        return f"http://{self.name}"


def _start(servers) -> None:
    EngineFleet._start_servers(SimpleNamespace(servers=servers))


def test_engines_start_at_the_same_time():
    together = threading.Barrier(3, timeout=10)  # breaks (and fails the start) unless all three wait in it at once
    servers = [Server(i, together.wait) for i in range(3)]
    _start(servers)
    assert all(s.started for s in servers)


def test_a_failed_start_is_raised_after_every_start_ended_naming_each_engine_that_failed():
    def no_binary():
        raise FileNotFoundError("vllm: no such file")

    def unhealthy():
        raise EngineStartError("engine-2: not healthy after engine_startup_timeout_s=600.0 s")

    slow = Server(0, lambda: time.sleep(0.3))
    servers = [slow, Server(1, no_binary), Server(2, unhealthy)]
    with pytest.raises(FileNotFoundError) as info:
        _start(servers)
    assert slow.started  # waited for, so a shutdown after the failure cannot race it
    assert info.value.__notes__ == [
        "while starting engine-1",
        (
            "engine-2 failed to start as well: EngineStartError: engine-2: not healthy after "
            "engine_startup_timeout_s=600.0 s"
        ),
    ]


def test_one_engine_starts_in_the_calling_thread():
    caller = threading.current_thread()
    seen = []
    _start([Server(0, lambda: seen.append(threading.current_thread()))])
    assert seen == [caller]


class Router:
    """A stand-in vllm-router: `start` runs `on_start` (a barrier, an error)."""

    made: list["Router"] = []

    def __init__(self, policy, log_dir=None) -> None:
        self.stopped = False
        Router.made.append(self)

    def start(self) -> str:
        Router.on_start()
        return "http://router"

    def shutdown(self) -> None:
        self.stopped = True


def _fleet(monkeypatch, servers, on_router_start):
    monkeypatch.setattr("vime_core.engines.fleet.Router", Router)
    Router.made, Router.on_start = [], staticmethod(on_router_start)
    fleet = SimpleNamespace(
        servers=servers,
        _owns_servers=True,
        router=None,
        cfg=SimpleNamespace(use_router=True, router_policy="round_robin"),
    )
    fleet._start_servers = lambda: EngineFleet._start_servers(fleet)
    return fleet


def _raise(exc: BaseException):
    def fail():
        raise exc

    return fail


def test_the_router_starts_beside_the_engines(monkeypatch):
    together = threading.Barrier(3, timeout=10)  # the router and both engines inside their starts at once
    fleet = _fleet(monkeypatch, [Server(i, together.wait) for i in range(2)], together.wait)
    EngineFleet._start_servers_and_router(fleet, None)
    [router] = Router.made
    assert fleet.router is router and not router.stopped


@pytest.mark.parametrize("engine_fails, router_fails", [(False, True), (True, True), (True, False)])
def test_a_failed_start_raises_the_engines_error_first_and_leaves_no_router_unowned(
    monkeypatch, engine_fails, router_fails
):
    engine = _raise(EngineStartError("engine down")) if engine_fails else None
    fleet = _fleet(
        monkeypatch, [Server(0, engine)], _raise(RuntimeError("router down")) if router_fails else (lambda: None)
    )
    with pytest.raises(
        EngineStartError if engine_fails else RuntimeError, match="engine down" if engine_fails else "router down"
    ):
        EngineFleet._start_servers_and_router(fleet, None)
    [router] = Router.made
    # a router that failed is stopped here; one that started is the fleet's, which the
    # constructor's shutdown (on any failure) stops
    assert (router.stopped, fleet.router) == ((True, None) if router_fails else (False, router))
