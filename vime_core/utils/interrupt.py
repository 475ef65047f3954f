"""How `vime train` stops on Ctrl-C (SIGINT) or SIGTERM: either signal prints where the run stands and
raises KeyboardInterrupt, so the flows unwind; the process exits at most `grace_s` later whatever the
unwinding does (130 for SIGINT, 143 for SIGTERM), at once on a second signal. Stored batches and
checkpoints are atomic, so the same command resumes."""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
from typing import Optional

GRACE_S = 10.0
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}

_installed: Optional["_Handler"] = None


class _Handler:
    """The Python-level handler (main thread) and the watcher thread that enforces the deadline."""

    def __init__(self, message: str, grace_s: float) -> None:
        self.message = message
        self.grace_s = grace_s
        self.received: Optional[int] = None
        self._raised = False
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # the C-level handler must never block on it
        signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, name="vime-interrupt", daemon=True).start()

    def __call__(self, signum: int, frame: object) -> None:
        if self._raised:  # a second signal: no more unwinding
            os._exit(EXIT_STATUS.get(signum, 128 + signum))
        self._raised = True
        if self.received is None:
            self.received = signum
        try:  # in case something replaced the wakeup fd: the watcher still hears of it
            os.write(self._write_fd, bytes([signum]))
        except OSError:
            pass
        raise KeyboardInterrupt

    def _watch(self) -> None:
        deadline: Optional[float] = None
        status = 130
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if not ready:  # the grace period is over
                os._exit(status)
            for signum in os.read(self._read_fd, 64):
                if signum not in EXIT_STATUS or deadline is not None:
                    continue
                if self.received is None:
                    self.received = signum
                status = EXIT_STATUS[self.received]
                deadline = time.monotonic() + self.grace_s
                sys.stderr.write(self.message)
                sys.stderr.flush()


def install(message: str, grace_s: float = GRACE_S) -> None:
    """Handle SIGINT and SIGTERM (module docstring); `message` goes to stderr once.
    Main thread only (the wakeup fd and signal handlers are the main thread's).

    Why a deadline: the signal also reaches Prefect's temporary server, and Prefect then reports the
    crash to that dead server with retries and backoff. Why a watcher thread started here, not a timer
    started by the handler: every Prefect flow run replaces the SIGTERM handler with its own
    (capture_sigterm), and a handler that starts a thread can deadlock on threading's lock. So the
    interpreter's wakeup fd (signal.set_wakeup_fd) feeds every caught signal to the thread, whatever
    Python handler runs; the Python handler only raises KeyboardInterrupt."""
    global _installed
    _installed = _Handler(message, grace_s)
    reinstall()


def reinstall() -> None:
    """Put the handler back where a Prefect flow run replaced it (main thread only).

    The train and iteration flows call it first; it does nothing unless the CLI called `install`
    (under a Prefect worker SIGTERM is the runner's cancellation and stays Prefect's)."""
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
