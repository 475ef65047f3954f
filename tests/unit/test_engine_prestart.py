"""EngineServer.prestart (vime_core/engines/server.py): the launch `vime train` begins as soon as
an engine actor exists. A start() that comes meanwhile waits for it and returns its URL (never a
URL that is not serving yet, never a second launch); a prestart's failure reaches the start()
that waits, once."""

from __future__ import annotations

import threading

import pytest

from vime_core.config.loader import make_config
from vime_core.engines.server import EngineServer, EngineStartError


@pytest.fixture
def server(monkeypatch):
    srv = EngineServer(make_config({"run_name": "prestart", "device": "cpu"}))
    srv.launches = 0
    srv.serving = threading.Event()
    srv.failure = None

    def fake_start():  # what _start does: launch once, block until healthy, the URL
        if srv.url is None:
            srv.launches += 1
            if not srv.serving.wait(10):
                raise AssertionError("the test never let the server serve")
            if srv.failure is not None:
                raise srv.failure
            srv.url = "http://127.0.0.1:9"
        return srv.url

    monkeypatch.setattr(srv, "_start", fake_start)
    return srv


def test_a_start_during_a_prestart_waits_for_it_and_launches_nothing_more(server):
    pre = threading.Thread(target=server.prestart)
    pre.start()
    got: list[str] = []
    waiter = threading.Thread(target=lambda: got.append(server.start()))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and got == []  # not serving yet: start() has not returned
    server.serving.set()
    pre.join(5)
    waiter.join(5)
    assert got == ["http://127.0.0.1:9"] and server.launches == 1


def test_a_prestarts_failure_is_raised_by_the_start_that_waits_then_a_start_launches_again(server):
    server.failure = EngineStartError("engine-0 exited during startup (code 1)")
    server.serving.set()
    server.prestart()  # the failure is kept, not raised in the actor's thread
    with pytest.raises(EngineStartError, match="exited during startup"):
        server.start()
    server.failure = None
    assert server.start() == "http://127.0.0.1:9"  # raised once: this start launches again
    assert server.launches == 2
