"""vime_core/utils/orphan_guard.py with real processes: a server started under the guard dies
when the process that started it is SIGKILLed, or when the guard itself is; a normal shutdown
and the server's exit status pass through."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from vime_core.utils.orphan_guard import guard_command
from vime_core.utils.processes import pid_alive, terminate_group
from vime_core.utils.retry import poll_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _gone_within(pid: int, seconds: float) -> bool:
    return poll_until(lambda: not pid_alive(pid), seconds, 0.05)


def _server_pid_of(guard_pid: int, seconds: float = 10) -> int:
    """The guard's child (the server), once it exists."""
    assert poll_until(lambda: psutil.Process(guard_pid).children(), seconds, 0.05), (
        f"guard {guard_pid} started no server"
    )
    return psutil.Process(guard_pid).children()[0].pid


STARTER = textwrap.dedent("""
    import subprocess, sys, time
    from vime_core.utils.orphan_guard import guard_command
    guard = subprocess.Popen(guard_command(["sleep", "600"], poll_s=0.1, grace_s=2), start_new_session=True)
    print(guard.pid, flush=True)
    time.sleep(600)
""")


def test_the_server_dies_with_the_process_that_started_it(repo_root):
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    guard = int(starter.stdout.readline())
    server = _server_pid_of(guard)
    assert pid_alive(server)
    starter.kill()  # SIGKILL: the starter runs no cleanup of its own
    starter.wait()
    assert _gone_within(server, 10), "the server outlived the process that started it"
    assert _gone_within(guard, 10)


def test_the_server_dies_with_a_killed_guard():
    guard = subprocess.Popen(guard_command(["sleep", "600"], poll_s=0.1), start_new_session=True)
    server = _server_pid_of(guard.pid)
    guard.kill()
    guard.wait()
    assert _gone_within(server, 10), "PR_SET_PDEATHSIG did not take the server with the guard"


def test_a_shutdown_of_the_group_stops_both_and_the_exit_status_passes_through():
    guard = subprocess.Popen(guard_command(["sleep", "600"]), start_new_session=True)
    server = _server_pid_of(guard.pid)
    terminate_group(guard, grace_s=5, name="sleep")
    assert guard.returncode == 128 + signal.SIGTERM  # the server's end, as a shell reports it
    assert _gone_within(server, 5)
    done = subprocess.run(guard_command(["sh", "-c", "exit 3"]), timeout=30)
    assert done.returncode == 3


def test_the_server_gets_the_environment_the_guard_is_not_disturbed_by_it(tmp_path):
    # a PYTHONPATH meant for the server (here: a module shadowing the stdlib's argparse) must not
    # break the guard, which runs isolated, while the server still sees it
    (tmp_path / "argparse.py").write_text("raise SystemExit('shadowed')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "VIME_PROBE": "seen"}
    done = subprocess.run(
        guard_command(["sh", "-c", 'echo "$VIME_PROBE $PYTHONPATH"']),
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["seen", str(tmp_path)]


def test_cpus_pin_the_server_and_the_processes_it_starts():
    core = min(os.sched_getaffinity(0))
    child = "import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); sys.stdout.flush(); " + (
        "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'])"
    )
    done = subprocess.run(
        guard_command([sys.executable, "-c", child], cpus=[core]), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [f"[{core}]", f"[{core}]"]
    unpinned = subprocess.run(guard_command([sys.executable, "-c", child]), capture_output=True, text=True, timeout=30)
    assert unpinned.stdout.split("\n")[0] == str(sorted(os.sched_getaffinity(0)))
