"""Tool calls in a sandbox: a Python function (`module:function`, JSON in, JSON out) run in a child
process with a time limit, a memory limit, no file system and no network, because a tool answers
(and may run) code the model wrote, which must not reach the trainer's files, credentials or
network, nor hold the rollout forever."""

from __future__ import annotations

import json
import os
import queue
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from vime_core.rollout.multi_turn import ToolResult

CHILD = Path(__file__).with_name("sandbox_child.py")
STARTUP_TIMEOUT_S = 60.0  # the child imports the target's module once


class SandboxError(RuntimeError):
    """A sandboxed call did not return a value."""


class SandboxTimeout(SandboxError):
    """The call did not answer within wall_s; its process was killed."""


class SandboxRefused(SandboxError):
    """The call tried what the sandbox does not allow (a file, a socket, a process), or ran out of memory."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 5.0
    """Seconds one call may take before its process is killed."""
    memory_mb: int = 512
    """Address space of a child process in MiB (the interpreter itself takes ~30 of them)."""
    network_namespace: bool = True
    """Run the child in a network namespace of its own when `unshare --user --net` works here."""


_UNSHARE: Optional[list[str]] = None


def _unshare_prefix() -> list[str]:
    """`unshare --user --map-root-user --net` when it works on this host (user namespaces on), else []."""
    global _UNSHARE
    if _UNSHARE is None:
        binary = shutil.which("unshare")
        ok = False
        if binary:
            try:
                ok = subprocess.run([binary, "-rn", "true"], capture_output=True, timeout=10).returncode == 0
            except (OSError, subprocess.TimeoutExpired):
                ok = False
        _UNSHARE = [binary, "--user", "--map-root-user", "--net"] if ok else []
    return _UNSHARE


class _Child:
    """One sandbox process serving calls of one target."""

    def __init__(self, target: str, limits: SandboxLimits, cpu_s: Optional[int]) -> None:
        self.workdir = tempfile.mkdtemp(prefix="vime-sandbox-")
        prefix = _unshare_prefix() if limits.network_namespace else []
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}  # nothing of the parent's
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-I", str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.workdir,
            env=env,
            start_new_session=True,
            text=True,
            bufsize=1,
        )
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.proc.stdout, selectors.EVENT_READ)
        self._send(
            {
                "target": target,
                "path": [p for p in sys.path if p],
                "memory_bytes": limits.memory_mb * 2**20,
                "cpu_s": cpu_s,
            }
        )
        reply = self._receive(STARTUP_TIMEOUT_S)
        if not reply.get("ready"):
            self.kill()
            raise SandboxError(f"the sandbox could not start {target}: {reply.get('error')}")

    def _send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def _receive(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.selector.select(left):
                raise SandboxTimeout(f"no answer within {timeout_s:g} s")
            line = self.proc.stdout.readline()
            if not line:
                code = self.proc.wait(timeout=5)
                why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                raise SandboxError(f"the sandbox process ended ({why})")
            return json.loads(line)

    def call(self, argument: Any, wall_s: float) -> Any:
        self._send({"argument": argument})
        reply = self._receive(wall_s)
        if reply.get("ok"):
            return reply["value"]
        error = SandboxRefused if reply.get("kind") in ("memory", "refused") else SandboxError
        raise error(reply.get("error", "the call failed"))

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.selector.close()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        shutil.rmtree(self.workdir, ignore_errors=True)


class SandboxedFunction:
    """`target` ("module:function", importable by this process) called in the sandbox: JSON-able argument
    in, JSON-able value out. Thread-safe; at most `max_children` children at once, the others wait.

        time     no answer within wall_s: the process group is killed, SandboxTimeout
        memory   RLIMIT_AS of memory_mb: MemoryError in the child, SandboxRefused
        files    RLIMIT_NOFILE at the descriptors open after import, RLIMIT_FSIZE 0, and an audit hook
                 refusing path operations, processes, ctypes and new imports
        network  its own network namespace where `unshare --user --net` works; always no socket

    Children (sandbox_child.py: `python -I`, empty environment and folder) serve many calls;
    `fresh_per_call` gives each call its own. The audit hook is Python's, not the kernel's: code that
    corrupts the interpreter could get past it, not past the limits."""

    def __init__(
        self, target: str, limits: SandboxLimits = SandboxLimits(), fresh_per_call: bool = False, max_children: int = 2
    ) -> None:
        if ":" not in target:
            raise ValueError(f"sandbox target {target!r} is not module:function")
        self.target, self.limits, self.fresh = target, limits, fresh_per_call
        self._idle: "queue.LifoQueue[_Child]" = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max_children)

    def __call__(self, argument: Any) -> Any:
        with self._slots:
            child = self._take()
            try:
                value = child.call(argument, self.limits.wall_s)
            except (SandboxTimeout, SandboxError) as exc:
                # a timed-out, crashed or refused child is not reused: its state is unknown
                child.kill()
                if isinstance(exc, SandboxTimeout):
                    raise SandboxTimeout(f"{self.target} did not answer within {self.limits.wall_s:g} s") from None
                raise
            if self.fresh:
                child.kill()
            else:
                self._idle.put(child)
            return value

    def _take(self) -> _Child:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            cpu_s = max(1, int(self.limits.wall_s + 0.999)) if self.fresh else None
            return _Child(self.target, self.limits, cpu_s)

    def close(self) -> None:
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                return

    def __del__(self) -> None:
        self.close()


class SandboxedTool:
    """A multi-turn tool (vime_core/rollout/multi_turn.py) whose calls run in the sandbox: `target`
    takes the response text and returns {"call", "output", "error"}; a call the sandbox stops
    answers nothing, with the reason as its error."""

    def __init__(
        self,
        target: str,
        call_marker: str,
        limits: SandboxLimits = SandboxLimits(),
        fresh_per_call: bool = False,
        max_children: int = 2,
    ) -> None:
        self.call_marker = call_marker
        self.function = SandboxedFunction(target, limits, fresh_per_call, max_children)

    def __call__(self, response_text: str) -> ToolResult:
        try:
            answer = self.function(response_text)
        except SandboxError as exc:
            return ToolResult(call="", output="", error=f"sandbox: {exc}")
        return ToolResult(
            call=str(answer.get("call", "")), output=str(answer.get("output", "")), error=answer.get("error")
        )
