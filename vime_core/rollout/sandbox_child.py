"""The child side of vime_core/rollout/sandbox.py, run as a script by `python -I` (standard library only,
no vime imports): it imports the target, locks itself down, then answers calls over stdin/stdout,
one JSON object per line."""

import importlib
import json
import os
import resource
import sys

DENIED_EVENTS = (
    "open",
    "os.",
    "shutil.",
    "socket.",
    "subprocess.",
    "_posixsubprocess",
    "pty.",
    "ctypes.",
    "mmap.",
    "fcntl.",
    "signal.",
    "import",
    "builtins.input",
    "resource.setrlimit",
    "resource.prlimit",
    "sys.addaudithook",
    "urllib.",
    "http.",
    "ftplib.",
    "smtplib.",
    "poplib.",
    "imaplib.",
    "nntplib.",
    "telnetlib.",
    "webbrowser.",
    "glob.",
    "tempfile.",
    "sqlite3.",
    "pathlib.",
    "syslog.",
    "cpython.remote_debugger_script",
)


class Refused(PermissionError):
    """An operation the sandbox does not allow."""


def _audit(event: str, args: tuple) -> None:
    if event.startswith(DENIED_EVENTS):
        raise Refused(f"the sandbox refuses {event}")


def _send(out, message: dict) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _error(exc: BaseException) -> dict:
    kind = "memory" if isinstance(exc, MemoryError) else "refused" if isinstance(exc, Refused) else "error"
    return {"ok": False, "kind": kind, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _lock_down(memory_bytes: int, cpu_s) -> None:
    """Limits that cannot be lifted (raising one is refused): RLIMIT_AS of memory_bytes, RLIMIT_CPU of cpu_s
    when given, RLIMIT_NOFILE at the descriptors open now (no file or socket can be opened),
    RLIMIT_FSIZE 0, and an audit hook refusing file-system operations, processes, sockets, ctypes,
    signals, new imports, reading stdin and limit changes."""
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1, highest + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    if cpu_s:
        resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_s), int(cpu_s) + 1))
    sys.addaudithook(_audit)


def main() -> None:
    """Serve calls of one target until stdin closes:

        parent -> child   {"target": "pkg.mod:fn", "path": [...], "memory_bytes": N, "cpu_s": S or null}
        child -> parent   {"ready": true} once the target is imported and the limits are on,
                          or {"ok": false, "kind": "setup", "error": "..."}
        parent -> child   {"argument": ...}    one call
        child -> parent   {"ok": true, "value": ...}
                          | {"ok": false, "kind": "memory"|"refused"|"error", "error": "Type: text"}

    What the target prints goes to stderr, never into the protocol."""
    stdin, out = sys.stdin, sys.stdout
    sys.stdout = sys.stderr  # what the target prints does not reach the protocol
    try:
        setup = json.loads(stdin.readline())
        sys.path[:0] = setup["path"]
        module, _, name = setup["target"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        _lock_down(setup["memory_bytes"], setup.get("cpu_s"))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        _send(out, {**_error(exc), "kind": "setup"})
        return
    _send(out, {"ready": True})
    for line in stdin:
        try:
            value = fn(json.loads(line)["argument"])
            reply = {"ok": True, "value": value}
            text = json.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - the call's failure is its answer
            text = json.dumps(_error(exc))
        out.write(text + "\n")
        out.flush()


if __name__ == "__main__":
    main()
