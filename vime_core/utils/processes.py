"""Child-process plumbing shared by the helpers that start and stop servers (engines, router,
Ray nodes, SeaweedFS): free loopback ports, processes through psutil, log tails, stopping a
process group without leaving children behind."""

from __future__ import annotations

import logging
import os
import random
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


# Below the kernel's ephemeral range (Linux's default 32768-60999), where the outbound connections'
# source ports come from: a port picked there can be taken by any connection before its server binds
# it, or between a server's exit and its restart on the same port.
LISTEN_PORTS = (20000, 32768)
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORT_TRIES = 64
_PICKER = random.SystemRandom()  # not the seeded module state: processes seeded alike would pick alike


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(v) for v in EPHEMERAL_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago: a random one of LISTEN_PORTS outside the
    kernel's ephemeral range, else (every try taken, or no room outside the range) the OS's pick."""
    low, high = _ephemeral_range()
    candidates = [p for p in range(*LISTEN_PORTS) if not low <= p <= high]
    for port in _PICKER.sample(candidates, min(FREE_PORT_TRIES, len(candidates))):
        if port_is_free("127.0.0.1", port, reuse_address=False):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(host: str, port: int, reuse_address: bool = True) -> bool:
    """Whether `port` on `host` can be bound now. `reuse_address` (SO_REUSEADDR): a port in
    TIME_WAIT counts as free, as it does for a server that binds it so; without, only a port no
    socket holds in any state."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if reuse_address:
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
