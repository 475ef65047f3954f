"""Run a server so that it dies with the process that started it.

Servers run in a session of their own (a shutdown signals the whole group), which also outlives a
SIGKILLed Ray actor that started them. The guard sits between: it polls its parent and, once
reparented, SIGTERMs the group (SIGKILL after --grace-s); the server gets PR_SET_PDEATHSIG, so a
killed guard takes it along. `--cpus` pins the server (and every process it starts) to a core set
before it runs. Standard library only.

    python orphan_guard.py [--poll-s S] [--grace-s S] [--cpus 0,1] -- COMMAND [ARGS...]"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
from typing import Iterable, Optional

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the server's process between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def guard_command(
    command: list[str], poll_s: float = 1.0, grace_s: float = 10.0, cpus: Optional[Iterable[int]] = None
) -> list[str]:
    """`command` run under the guard by this interpreter (isolated: the PYTHONPATH meant for the
    server does not reach the guard's imports; the server still inherits it); `cpus`: the cores
    the server may run on (None: those of the guard)."""
    pin = ["--cpus", ",".join(str(c) for c in sorted(cpus))] if cpus is not None else []
    return [
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        "--poll-s",
        str(poll_s),
        "--grace-s",
        str(grace_s),
        *pin,
        "--",
        *command,
    ]


def _exit_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def run(command: list[str], poll_s: float, grace_s: float, cpus: Optional[set[int]] = None) -> int:
    parent = os.getppid()
    if cpus is not None:  # the guard's own affinity, which the server inherits from its first instruction
        os.sched_setaffinity(0, cpus)
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
    p.add_argument("--cpus", default=None, help="comma-separated core ids the server may run on")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        p.error("no command to run")
    cpus = {int(c) for c in a.cpus.split(",")} if a.cpus else None
    return run(command, a.poll_s, a.grace_s, cpus)


if __name__ == "__main__":
    sys.exit(main())
