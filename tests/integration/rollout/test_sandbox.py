"""The tool sandbox (vime_core/rollout/sandbox.py) with real child processes: a call that tries to
read or write a file, remove one, list a folder, open a socket to a listener of this test, start
a process, load a library, lift its own limits, take more memory than allowed or run forever is
stopped, and what it tried did not happen (the files are unchanged, the listener saw no
connection); the sandbox keeps answering afterwards, and the recipes' calculator answers from it."""

from __future__ import annotations

import socket
import time

import pytest

from vime_core.rollout.sandbox import SandboxedFunction, SandboxLimits, SandboxRefused, SandboxTimeout

TARGET = "tests.integration.rollout.sandbox_targets:run_code"
WALL_S = 2.0


@pytest.fixture(scope="module")
def sandbox():
    function = SandboxedFunction(TARGET, SandboxLimits(wall_s=WALL_S, memory_mb=256))
    yield function
    function.close()


@pytest.fixture
def listener():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    yield server
    server.close()


def _accepted(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_plain_code_runs_and_returns_its_value(sandbox):
    assert sandbox("result = sum(i * i for i in range(10))") == sum(i * i for i in range(10))


def test_files_cannot_be_read_written_removed_or_listed(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("canary-content")
    attempts = [
        f"result = open({str(secret)!r}).read()",
        f"open({str(tmp_path / 'planted')!r}, 'w').write('x')",
        f"import os; os.remove({str(secret)!r})",
        f"__import__('os').rename({str(secret)!r}, {str(tmp_path / 'moved')!r})",
        f"result = __import__('os').listdir({str(tmp_path)!r})",
        f"result = __import__('pathlib').Path({str(secret)!r}).read_text()",
    ]
    for code in attempts:
        with pytest.raises(SandboxRefused, match="the sandbox refuses"):
            sandbox(code)
    assert secret.read_text() == "canary-content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt"]


def test_no_network(sandbox, listener):
    port = listener.getsockname()[1]
    for code in (
        f"import socket; socket.create_connection(('127.0.0.1', {port}))",
        f"result = __import__('socket').create_connection(('127.0.0.1', {port}))",
        "import urllib.request",
    ):
        with pytest.raises(SandboxRefused):
            sandbox(code)
    time.sleep(0.1)
    assert not _accepted(listener), "a sandboxed call reached the test's listener"


def test_no_process_no_library_no_lifting_a_limit(sandbox, tmp_path):
    for code in (
        f"__import__('os').system('touch {tmp_path}/by-shell')",
        "import subprocess",
        "import ctypes",
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
        "__import__('os').fork()",
    ):
        with pytest.raises(SandboxRefused):
            sandbox(code)
    assert not (tmp_path / "by-shell").exists()


def test_memory_beyond_the_limit_is_refused(sandbox):
    with pytest.raises(SandboxRefused, match="MemoryError"):
        sandbox("result = len(bytearray(512 * 2**20))")
    assert sandbox("result = len(bytearray(16 * 2**20))") == 16 * 2**20


def test_a_call_that_runs_forever_is_killed_at_the_time_limit(sandbox):
    start = time.monotonic()
    with pytest.raises(SandboxTimeout, match=f"within {WALL_S:g} s"):
        sandbox("while True: pass")
    took = time.monotonic() - start
    assert WALL_S <= took < WALL_S + 5.0
    assert sandbox("result = 7") == 7  # a new child serves the next call


def test_a_fresh_child_per_call_shares_nothing_between_calls():
    function = SandboxedFunction(TARGET, SandboxLimits(wall_s=WALL_S, memory_mb=256), fresh_per_call=True)
    try:
        assert function("import sys; sys.modules['builtins'].planted = 1; result = 1") == 1
        assert function("import builtins; result = hasattr(builtins, 'planted')") is False
    finally:
        function.close()


def test_the_recipe_calculator_answers_from_its_sandbox():
    from recipes.tool_use.calculator import CALCULATOR, SANDBOXED_CALCULATOR

    for text in ("3*4=", "12+5*2=", "1 2=", "99999999999999*9="):
        assert SANDBOXED_CALCULATOR(text) == CALCULATOR(text)
