"""Processes (through psutil) and free loopback ports, shared by the helpers that start and stop
servers."""

from __future__ import annotations

import os
import socket

import psutil


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
