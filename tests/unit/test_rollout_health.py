"""HealthMonitor with stub servers: a dead engine is restarted, given weights before the router
sees it again, and nothing happens while the monitor is paused (offload)."""

from __future__ import annotations

import pytest

from vime_core.engines.health import HealthMonitor

pytestmark = pytest.mark.timeout(30)


class StubServer:
    def __init__(self, url: str, alive: bool = True, restart_url: str | None = None, fail_restart: bool = False):
        self.url = url
        self.alive = alive
        self.restart_url = restart_url or url
        self.fail_restart = fail_restart
        self.attach_url = None
        self.restarts = 0

    def process_exited(self) -> bool:
        return not self.alive  # a dead stub's process is gone

    def is_alive(self) -> bool:
        return self.alive

    def restart(self) -> str:
        if self.fail_restart:
            raise RuntimeError("port in use")
        self.restarts += 1
        self.alive = True
        self.url = self.restart_url
        return self.url


def test_dead_engine_is_restarted_weights_first_then_rerouted():
    events = []
    servers = [StubServer("http://a"), StubServer("http://b", alive=False, restart_url="http://b2")]
    monitor = HealthMonitor(
        servers,
        on_restarted=lambda i, url: events.append(("weights", i, url)),
        on_url_changed=lambda old, new: events.append(("route", old, new)),
    )
    monitor.resume()
    assert monitor.check_now() == 1
    assert events == [("weights", 1, "http://b2"), ("route", "http://b", "http://b2")]
    assert servers[0].restarts == 0 and servers[1].restarts == 1 and monitor.restarts == 1
    assert monitor.check_now() == 0  # healthy again


def test_paused_monitor_leaves_sleeping_engines_alone():
    server = StubServer("http://a", alive=False)
    monitor = HealthMonitor([server])
    monitor.pause()
    assert monitor.check_now() == 0 and server.restarts == 0
    monitor.resume()
    assert monitor.check_now() == 1


def test_failed_restart_is_recorded_not_raised():
    server = StubServer("http://a", alive=False, fail_restart=True)
    monitor = HealthMonitor([server])
    monitor.resume()
    assert monitor.check_now() == 0
    assert "port in use" in monitor.errors[0]


def test_attached_engines_are_not_restarted():
    server = StubServer("http://ext", alive=False)
    server.attach_url = "http://ext"
    monitor = HealthMonitor([server])
    monitor.resume()
    assert monitor.check_now() == 0 and server.restarts == 0


def test_background_thread_starts_and_stops():
    server = StubServer("http://a", alive=False)
    monitor = HealthMonitor([server], interval_s=0.01)
    monitor.start()
    import time

    deadline = time.monotonic() + 5
    while server.restarts == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    monitor.stop()
    assert server.restarts == 1


@pytest.mark.parametrize("fail_restart", [False, True])
def test_admission_is_held_from_before_the_restart_until_after_the_publish(fail_restart):
    """A restarted server may answer on its old URL before it holds the trainer's weights: no
    new request may go out until the weights are published (and the gate opens again after a
    failed restart, so the other engines keep serving)."""
    from vime_core.engines.admission import SYNC, Admission

    gate = Admission()
    seen = []
    server = StubServer("http://a", alive=False, fail_restart=fail_restart)
    real_restart = server.restart

    def restart() -> str:
        seen.append(("restart", gate.is_set()))
        return real_restart()

    server.restart = restart
    monitor = HealthMonitor(
        [server],
        on_restarted=lambda i, url: seen.append(("weights", gate.is_set())),
        on_url_changed=lambda old, new: seen.append(("route", gate.is_set())),
        holding=lambda i: gate.held(f"restart of engine {i}"),
    )
    monitor.resume()
    gate.hold(SYNC)  # a sync under way keeps its hold after the restart
    monitor.check_now()
    expected = [("restart", False)] if fail_restart else [("restart", False), ("weights", False), ("route", False)]
    assert seen == expected
    assert gate.holders() == {SYNC} and not gate.is_set()
    gate.release(SYNC)
    assert gate.is_set()


def test_admission_opens_only_when_every_holder_let_go():
    from vime_core.engines.admission import Admission

    gate = Admission()
    gate.hold("sync")
    gate.hold("sync")
    with gate.held("restart of engine 0"):
        gate.release("sync")
        assert not gate.is_set() and gate.holders() == {"restart of engine 0"}
    assert gate.is_set() and gate.holders() == set()
