"""Run a server so that it dies with the process that started it.

Servers run in a session of their own (a shutdown signals the whole group), which also outlives a
SIGKILLed Ray actor that started them. The guard sits between: it polls its parent and, once
reparented, SIGTERMs the group (SIGKILL after --grace-s); the server gets PR_SET_PDEATHSIG, so a
killed guard takes it along. Standard library only.

    python orphan_guard.py [--poll-s S] [--grace-s S] -- COMMAND [ARGS...]"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the server's process between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def guard_command(command: list[str], poll_s: float = 1.0, grace_s: float = 10.0) -> list[str]:
    """`command` run under the guard by this interpreter (isolated: the PYTHONPATH meant for the
    server does not reach the guard's imports; the server still inherits it)."""
    return [
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        "--poll-s",
        str(poll_s),
        "--grace-s",
        str(grace_s),
        "--",
        *command,
    ]


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(command: list[str], poll_s: float, grace_s: float) -> int:
    parent = os.getppid()
    server = subprocess.Popen(command, preexec_fn=_die_with_parent)

    def pass_on(signum: int, _frame: object) -> None:
        if server.poll() is None:
            server.send_signal(signum)

    signal.signal(signal.SIGTERM, pass_on)
    signal.signal(signal.SIGINT, pass_on)
    while True:
        try:
            return _exit_status(server.wait(timeout=poll_s))
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # reparented: whoever started us is gone
            print(
                f"[orphan_guard] parent {parent} died: stopping {command[0]} (pid {server.pid})",
                file=sys.stderr,
                flush=True,
            )
            os.killpg(os.getpgrp(), signal.SIGTERM)
            try:
                return _exit_status(server.wait(timeout=grace_s))
            except subprocess.TimeoutExpired:
                os.killpg(os.getpgrp(), signal.SIGKILL)
                return 128 + signal.SIGKILL


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--poll-s", type=float, default=1.0)
    p.add_argument("--grace-s", type=float, default=10.0)
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command to run")
    return run(command, a.poll_s, a.grace_s)


if __name__ == "__main__":
    sys.exit(main())
