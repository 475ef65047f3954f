"""How `vime train` stops on Ctrl-C (SIGINT) or SIGTERM (a scheduler preempting the job).

Either signal prints where the run stands and raises KeyboardInterrupt, so the flows unwind as
they do for Ctrl-C; the process then exits at most `grace_s` later, whatever the unwinding does
(exit status 130 for SIGINT, 143 for SIGTERM, as a shell reports them). A second signal exits
at once. Stored batches and checkpoints are complete files (atomic writes); the same command
resumes.

Why a deadline: the signal also reaches Prefect's temporary server (same process group), and
Prefect then reports the crash to that dead server with retries and backoff (measured: 75 s).

Why `reinstall`: every Prefect flow run replaces the SIGTERM handler with its own for the run's
duration (prefect.utilities.engine.capture_sigterm). Its TerminationSignal, raised inside a C
call, arrives as a SystemError that a task retry took for an ordinary failure (seen on the
H200: a driver SIGTERMed by `timeout` retried its train task and ran on until SIGKILL). The
train and iteration flows call `reinstall()` first; it does nothing unless the CLI called
`install` (under a Prefect worker SIGTERM is the runner's cancellation and stays Prefect's).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

GRACE_S = 10.0
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}

_installed: Optional["_Handler"] = None


class _Handler:
    def __init__(self, message: str, grace_s: float) -> None:
        self.message = message
        self.grace_s = grace_s
        self.received: Optional[int] = None

    def __call__(self, signum: int, frame: object) -> None:
        status = EXIT_STATUS.get(signum, 128 + signum)
        if self.received is not None:
            os._exit(status)
        self.received = signum
        sys.stderr.write(self.message)
        sys.stderr.flush()
        timer = threading.Timer(self.grace_s, os._exit, args=(status,))
        timer.daemon = True
        timer.start()
        raise KeyboardInterrupt


def install(message: str, grace_s: float = GRACE_S) -> None:
    """Handle SIGINT and SIGTERM as the module docstring says; `message` goes to stderr once."""
    global _installed
    _installed = _Handler(message, grace_s)
    reinstall()


def reinstall() -> None:
    """Put the handler back where a Prefect flow run replaced it (main thread only)."""
    if _installed is None or threading.current_thread() is not threading.main_thread():
        return
    for signum in EXIT_STATUS:
        signal.signal(signum, _installed)


def received() -> Optional[int]:
    """The signal this process was told to stop by, or None."""
    return None if _installed is None else _installed.received


def exit_status() -> int:
    """The status to exit with after an interrupt (130 when none was recorded)."""
    return EXIT_STATUS.get(received() or signal.SIGINT, 130)
