"""What the driver's console shows of a run's failures: one line for a failure the train flow explains
(retried infrastructure, a configuration or data error), a bug's traceback kept; Prefect's API, UI
and the debug log keep every line. `one_line_failures()` installs the three filters below while a
run starts and its iterations run."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

from vime_core.faults import UNKNOWN, classify

_PREFECT_RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")
# Ray's logger for its own errors on the driver (ray/_private/worker.py)
RAY_DRIVER_LOGGER = "ray._private.worker"
_TRACEBACK = "Traceback (most recent call last)"
_PREFECT_RETRY = " - Retry "  # Prefect: "Task run failed with ...: ... - Retry 1/3 will start ..."
_EXPLAINED = "vime_explained"  # set on a record whose failure the train flow says in its own line


class KnownFailureWithoutTraceback(logging.Filter):
    """Prefect logs every failed task and flow run with its traceback, a page each, and repeats
    the exception's text (a remote traceback, for an error raised in a Ray actor) in the message.
    For a failure the train flow explains in one line (an infrastructure failure it retries, a
    configuration or data error) the traceback is dropped; other failures (bugs) keep it. A
    traceback inside a message is cut off. Full tracebacks still reach the debug log
    (flows/train.py, retry_or_raise and start_failed)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info and record.levelno >= logging.WARNING else None
        if exc is not None and classify(exc).kind != UNKNOWN:
            record.exc_info, record.exc_text = None, None
            # a final failure (no retry of the task's own follows) the train flow says in its line
            setattr(record, _EXPLAINED, _PREFECT_RETRY not in record.getMessage())
        message = record.getMessage()
        if _TRACEBACK in message:
            record.msg, record.args = message[: message.index(_TRACEBACK)] + "... (traceback in the debug log)", None
        return True


class ExplainedFailuresOffTheConsole(logging.Filter):
    """On the console handler only (Prefect's API and UI keep every line): a task's or flow run's
    final failure that the train flow explains in its own line (retrying, or stopped and why),
    and Prefect's "Finished in state Failed(...)" line that repeats it, are left out; a task's
    own retry notice ("Retry 1/3 will start ...") and a bug's failure with its traceback stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name not in _PREFECT_RUN_LOGGERS:
            return True
        if getattr(record, _EXPLAINED, False):
            return False
        return not (record.levelno >= logging.WARNING and record.getMessage().startswith("Finished in state Failed"))


class RayErrorInOneLine(logging.Filter):
    """Ray logs an error that no caller collected ("Unhandled error ...", e.g. a chained call
    whose input failed) with the remote traceback, a page each. On the console it becomes one
    line: what Ray says, then the error itself (the traceback's last line); the traceback stays in
    the actor's log (Ray's session folder, logs/worker-*.err)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\n" in message:
            lines = [line.strip() for line in message.splitlines() if line.strip()]
            record.msg, record.args = f"{lines[0].split(':', 1)[0]}: {lines[-1]}", None
        return True


@contextmanager
def one_line_failures():
    """Install KnownFailureWithoutTraceback on Prefect's run loggers, RayErrorInOneLine on
    Ray's and ExplainedFailuresOffTheConsole on the console's handlers, while the run starts and
    its iterations run (`vime train` also around the flow, for the flow run's own failure line)."""
    installed: list[tuple[Any, logging.Filter]] = [
        (logging.getLogger(name), KnownFailureWithoutTraceback()) for name in _PREFECT_RUN_LOGGERS
    ]
    installed.append((logging.getLogger(RAY_DRIVER_LOGGER), RayErrorInOneLine()))
    installed += [(handler, ExplainedFailuresOffTheConsole()) for handler in _console_handlers()]
    for target, quiet in installed:
        target.addFilter(quiet)
    try:
        yield
    finally:
        for target, quiet in installed:
            target.removeFilter(quiet)


def _console_handlers() -> list[logging.Handler]:
    """The root logger's stream handlers (Prefect's console handler; what the user's terminal
    shows), not Prefect's API handler, which sits on the run loggers themselves."""
    return [
        h
        for h in logging.getLogger().handlers
        if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
    ]
