"""Child-process plumbing shared by the helpers that start and stop servers (engines, router,
Ray nodes, SeaweedFS): free loopback ports, processes through psutil, log tails, stopping a
process group without leaving children behind."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from pathlib import Path
from typing import Optional

import psutil

logger = logging.getLogger(__name__)


def process_started_epoch() -> float:
    """When this process started (epoch seconds; for `vime train`, the command)."""
    return psutil.Process().create_time()


def process_age_s() -> float:
    """Seconds since this process started (for `vime train`, since the command)."""
    return time.time() - process_started_epoch()


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int) -> bool:
    """Whether `port` on `host` can be bound now (SO_REUSEADDR: a port in TIME_WAIT counts as free)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; an exited process not yet reaped (a zombie) counts as gone: in a
    container whose init does not reap, a killed daemon stays a zombie for good."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def cmdline(pid: int) -> list[str]:
    """The arguments `pid` was started with ([] when it is gone or cannot be read)."""
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


def group_tree(pgid: int) -> list[int]:
    """Live processes of process group `pgid` and all their descendants (which may have made
    groups of their own, as Ray's actor workers do), sorted. psutil has no process-group field,
    so the group comes from os.getpgid."""
    parent: dict[int, int] = {}
    members = set()
    for proc in psutil.process_iter(["ppid", "status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        try:
            group = os.getpgid(proc.pid)
        except OSError:  # gone meanwhile
            continue
        parent[proc.pid] = proc.info["ppid"]
        if group == pgid:
            members.add(proc.pid)
    frontier = set(members)
    while frontier:
        children = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in members}
        members |= children
        frontier = children
    return sorted(members)


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
