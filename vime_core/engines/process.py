"""Child-process plumbing shared by the engine and router launchers: free ports, log tails,
stopping a process group without leaving children behind."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections import deque
from pathlib import Path
from typing import Optional

from vime_core.utils.processes import free_port  # noqa: F401  (re-exported for the launchers)

logger = logging.getLogger(__name__)


def log_tail(path: Optional[Path], lines: int = 40) -> str:
    """The last `lines` lines of a log file ("(no log)" when there is none)."""
    if path is None or not Path(path).exists():
        return "(no log)"
    with open(path, "r", errors="replace") as f:
        return "".join(deque(f, maxlen=lines))


def terminate_group(proc: subprocess.Popen, grace_s: float, name: str = "process") -> None:
    """SIGTERM the process group (started with start_new_session=True), SIGKILL it after
    `grace_s`, then SIGKILL the group once more: children may outlive their leader."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s: still running %.0f s after %s", name, wait_s, sig.name)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
