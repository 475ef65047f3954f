"""Process liveness from /proc (Linux) and free loopback ports, shared by the helpers that
start and stop servers."""

from __future__ import annotations

import socket
from pathlib import Path


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


def proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, process group id, state letter) of process `pid`, or None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ")".
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[2]), fields[0]


def pid_alive(pid: int) -> bool:
    """True while `pid` runs; an exited process not yet reaped (a zombie) counts as gone."""
    stat = proc_stat(pid)
    return stat is not None and stat[2] != "Z"
