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
