"""The real vllm-router dies with the process that started it (a RolloutManager SIGKILLed by Ray
or by the OOM killer), through vime_core/utils/orphan_guard.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from vime_core.utils.processes import pid_alive
from vime_core.utils.retry import poll_until

pytestmark = pytest.mark.timeout(120)

STARTER = textwrap.dedent("""
    import sys, time
    from vime_core.engines.router import Router
    router = Router("round_robin", log_dir=sys.argv[1])
    router.start()
    print(router.url, flush=True)
    time.sleep(600)
""")


def test_router_dies_with_its_starter(tmp_path, repo_root):
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo_root,
        env={**os.environ, "PYTHONPATH": str(repo_root)},
    )
    try:
        url = starter.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        started = psutil.Process(starter.pid).children(recursive=True)
        router = [p for p in started if "vllm-router" in " ".join(p.cmdline())]
        assert router, [p.cmdline() for p in started]
    finally:
        starter.kill()
        starter.wait()
    poll_until(lambda: not any(pid_alive(p.pid) for p in router), 20, 0.1)
    left = [p.pid for p in router if pid_alive(p.pid)]
    assert not left, f"vllm-router outlived the process that started it: {left}"
