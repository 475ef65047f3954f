"""Ctrl-C on `vime train`: the process ends within the grace period even when the unwinding
code swallows the interrupt and hangs (as Prefect's crash reporting does against its own
temporary server, which the same Ctrl-C killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, time
    from flows.cli import _exit_soon_after_interrupt
    _exit_soon_after_interrupt("interrupted: resume with --run-name x\\n", grace_s=1.0)
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        time.sleep(60)  # an exit hook that retries a dead server
""")


def _start() -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_first_ctrl_c_exits_130_within_the_grace_period_with_the_resume_hint():
    proc = _start()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=20)
    elapsed = time.monotonic() - t0
    assert rc == 130 and 0.9 < elapsed < 10, (rc, elapsed)
    assert "resume with --run-name x" in proc.stderr.read()


def test_second_ctrl_c_exits_at_once():
    proc = _start()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=20)
    assert rc == 130 and time.monotonic() - t0 < 0.8
