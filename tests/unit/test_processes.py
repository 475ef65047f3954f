"""Process helpers on psutil (vime_core/utils/processes.py) against real child processes: a
group's tree includes descendants that left the group, a zombie counts as gone."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from vime_core.utils.processes import cmdline, group_tree, pid_alive
from vime_core.utils.retry import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_group_tree_follows_descendants_and_zombies_count_as_gone():
    script = "sleep 60 & a=$!; setsid sleep 60 & b=$!; echo $a $b; wait"
    leader = subprocess.Popen(["bash", "-c", script], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        in_group, own_session = (int(p) for p in leader.stdout.readline().split())
        assert group_tree(leader.pid) == sorted([leader.pid, in_group, own_session])
        assert cmdline(leader.pid) == ["bash", "-c", script]
        assert all(pid_alive(p) for p in (leader.pid, in_group, own_session))
        os.killpg(leader.pid, signal.SIGKILL)  # the group only: the setsid child survives it
        os.kill(own_session, signal.SIGKILL)
        # the leader is our child and not reaped yet: a zombie, which counts as gone
        assert poll_until(lambda: not pid_alive(leader.pid), timeout_s=30, interval_s=0.05)
        assert leader.poll() is not None
    finally:
        leader.kill()
        leader.wait()
    assert not pid_alive(leader.pid) and cmdline(leader.pid) == [] and group_tree(leader.pid) == []


def test_free_ports_come_from_outside_the_kernels_ephemeral_range(tmp_path, monkeypatch):
    """Outbound connections take their source ports from the ephemeral range: a listening port picked
    there can be taken before its server binds it, or before a restarted server binds it again."""
    import random
    import socket

    from vime_core.utils import processes

    low, high = processes._ephemeral_range()
    random.seed(0)
    ports = {processes.free_port() for _ in range(20)}
    assert all(not low <= p <= high and processes.LISTEN_PORTS[0] <= p < processes.LISTEN_PORTS[1] for p in ports)
    assert len(ports) > 1  # random picks, not the module's seeded state
    # a port in use is passed over: of two, the one not held
    first = ports.pop()
    next_free = processes.port_is_free("127.0.0.1", first + 1, reuse_address=False)
    pair = (first, first + 1) if next_free else (first - 1, first)
    monkeypatch.setattr(processes, "LISTEN_PORTS", (pair[0], pair[1] + 1))
    with socket.socket() as held:
        held.bind(("127.0.0.1", pair[0]))
        assert {processes.free_port() for _ in range(5)} == {pair[1]}

    # a range file that leaves no room below it: the OS's pick
    narrow = tmp_path / "range"
    narrow.write_text("1024\t65535\n")
    monkeypatch.setattr(processes, "EPHEMERAL_RANGE_FILE", narrow)
    assert processes._ephemeral_range() == (1024, 65535)
    assert 1024 <= processes.free_port() <= 65535
