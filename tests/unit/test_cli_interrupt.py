"""Ctrl-C or SIGTERM on `vime train`: the process ends within the grace period even when the
unwinding code swallows the interrupt and hangs (as Prefect's crash reporting does against its own
temporary server, which the same signal killed), also inside a Prefect flow run, which takes
SIGTERM over, also when the signal finds Prefect's handler and the code swallows its
TerminationSignal, and when it lands while the main thread holds threading's own lock
(vime_core/utils/interrupt.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, time
    from vime_core.utils import interrupt
    interrupt.install("interrupted: resume with --run-name x\\n", grace_s=1.0)
    if sys.argv[1:] == ["in-flow"]:  # what a Prefect flow run does to SIGTERM, then what our flows do
        from prefect.utilities.engine import capture_sigterm
        scope = capture_sigterm()
        scope.__enter__()
        interrupt.reinstall()
    if sys.argv[1:] == ["prefect-window"]:  # a flow run starting: Prefect's handler, not ours yet
        from prefect.utilities.engine import capture_sigterm
        window = capture_sigterm()  # kept: collected, it would put our handler back
        window.__enter__()
        ready = False
        while True:
            try:
                if not ready:  # inside the try: the stop must not end the child before the grace period
                    ready = True
                    print("ready", flush=True)
                time.sleep(60)
            except BaseException:  # a retry that took the stop for an ordinary failure
                pass
    if sys.argv[1:] == ["lock-held"]:  # threading's lock, held as a thread starts
        import threading
        with threading._active_limbo_lock:
            try:
                print("ready", flush=True)  # inside the try: the KeyboardInterrupt must not end the child
                time.sleep(60)
            except KeyboardInterrupt:
                time.sleep(60)
    try:
        print("ready", flush=True)
        time.sleep(60)
    except KeyboardInterrupt:
        time.sleep(60)  # an exit hook that retries a dead server
""")


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.parametrize(
    "signum, where, status",
    [
        (signal.SIGINT, "outside", 130),
        (signal.SIGTERM, "outside", 143),  # a scheduler preempting the job
        (signal.SIGTERM, "in-flow", 143),  # while a Prefect flow run holds SIGTERM
        (signal.SIGTERM, "prefect-window", 143),  # before the flow's body put our handler back
        (signal.SIGTERM, "lock-held", 143),
    ],
)
def test_first_signal_exits_within_the_grace_period_with_the_resume_hint(signum, where, status):
    proc = _start(where)
    t0 = time.monotonic()
    proc.send_signal(signum)
    rc = proc.wait(timeout=20)
    elapsed = time.monotonic() - t0
    assert rc == status and 0.9 < elapsed < 10, (rc, elapsed)
    assert "resume with --run-name x" in proc.stderr.read()


def test_second_ctrl_c_exits_at_once():
    proc = _start()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=20)
    assert rc == 130 and time.monotonic() - t0 < 0.8


def test_a_task_is_not_retried_once_the_process_was_told_to_stop():
    """A signal raised inside a C call arrives as a SystemError caused by it (as Prefect's
    TerminationSignal does on a GPU host): that is the stop, not a failure to retry."""
    from tasks.common import retry_unless_configuration
    from tasks.signals import stopped_by_signal

    class State:
        def __init__(self, data):
            self.data = data

    def wrapped(cause: BaseException) -> SystemError:
        try:
            try:
                raise cause
            except BaseException as inner:
                raise SystemError(
                    "<built-in method __new__ of type object> returned a result with an exception set"
                ) from inner
        except SystemError as outer:
            return outer

    from prefect.exceptions import TerminationSignal

    for cause in (KeyboardInterrupt(), TerminationSignal(signal.SIGTERM)):
        assert stopped_by_signal(wrapped(cause))
        assert retry_unless_configuration(None, None, State(wrapped(cause))) is False
    assert not stopped_by_signal(wrapped(ConnectionError("refused")))
    assert retry_unless_configuration(None, None, State(wrapped(ConnectionError("refused")))) is True
