"""What a fault looks like: a dead actor is not retried by its task (only bootstrap rebuilds it),
and Ray's uncollected remote errors reach the console as one line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from ray.exceptions import ActorDiedError, ActorUnavailableError


def _retried(exc) -> bool:
    from tasks.common import retry_unless_configuration

    return retry_unless_configuration(None, None, SimpleNamespace(data=exc))


def test_a_task_does_not_retry_a_call_to_a_dead_actor():
    from vime_core.cluster.errors import ActorsMissingError
    from vime_core.faults import INFRASTRUCTURE, actor_died, classify

    dead = ActorDiedError()
    gone = ActorsMissingError("run 'r' has no trainer-0", ("trainer-0",))
    for exc in (dead, gone):
        assert actor_died(exc) and not _retried(exc)
        assert classify(exc).kind == INFRASTRUCTURE  # the iteration's retry rebuilds it
    unreachable = ActorUnavailableError("unreachable for now", None)
    assert not actor_died(unreachable) and _retried(unreachable)
    assert _retried(ConnectionResetError("reset"))


def test_an_uncollected_ray_error_is_one_line_on_the_console():
    from flows.console import RAY_DRIVER_LOGGER, one_line_failures

    remote = (
        "Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ray::RolloutManager.end_sync() (pid=1)\n"
        "  At least one of the input arguments for this task could not be computed:\n"
        '  File "/x/vime_core/engines/client.py", line 176, in request\n'
        "    raise EngineError(...)\n"
        "vime_core.engines.client.EngineError: engine engine-0: GET /weight_info failed (no answer)\n"
    )
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(RAY_DRIVER_LOGGER)
    handler = Keep()
    logger.addHandler(handler)
    try:
        with one_line_failures():
            logger.error(remote)
        logger.error(remote)  # outside the run: untouched
    finally:
        logger.removeHandler(handler)
    assert seen[0] == (
        "Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): "
        "vime_core.engines.client.EngineError: engine engine-0: GET /weight_info failed (no answer)"
    )
    assert seen[1] == remote


def _records_through(records):
    """Each record through the run loggers' filters, then the console handler's: what a terminal
    shows while one_line_failures is installed."""
    from flows.console import one_line_failures

    shown: list[str] = []

    class Console(logging.StreamHandler):
        def emit(self, record):
            shown.append(record.getMessage())

    root = logging.getLogger()
    console = Console()
    root.addHandler(console)
    try:
        with one_line_failures():
            for name, level, message, exc in records:
                logger = logging.getLogger(name)
                record = logger.makeRecord(
                    name, level, __file__, 0, message, None, (type(exc), exc, None) if exc is not None else None
                )
                if logger.filter(record) and console.filter(record):
                    console.emit(record)
    finally:
        root.removeHandler(console)
    return shown


def test_a_failure_the_run_explains_is_off_the_console_but_a_retry_notice_and_a_bug_stay():
    dead = ActorDiedError()
    bug = ZeroDivisionError("a bug")  # classified unknown: its traceback is the user's only clue
    retry = "Task run failed with exception: ConnectionResetError('reset') - Retry 1/3 will start 2 second(s) from now"
    shown = _records_through(
        [
            (
                "prefect.task_runs",
                logging.ERROR,
                "Task run failed with exception: ActorDiedError() - Retries are exhausted",
                dead,
            ),
            (
                "prefect.task_runs",
                logging.ERROR,
                "Finished in state Failed('Task run encountered an exception ActorDiedError')",
                None,
            ),
            ("prefect.flow_runs", logging.ERROR, "Encountered exception during execution: ActorDiedError()", dead),
            ("prefect.task_runs", logging.ERROR, retry, ConnectionResetError("reset")),
            ("prefect.task_runs", logging.ERROR, "Task run failed with exception: ZeroDivisionError('a bug')", bug),
            ("vime", logging.ERROR, "iteration 3 failed: trainer-0 died; retrying in 1 s", None),
        ]
    )
    assert shown == [
        retry,
        "Task run failed with exception: ZeroDivisionError('a bug')",
        "iteration 3 failed: trainer-0 died; retrying in 1 s",
    ]


def test_outside_a_run_the_console_shows_everything():
    logger = logging.getLogger("prefect.task_runs")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "Finished in state Failed('x')", None, None)
    assert logger.filter(record) and all(h.filter(record) for h in logging.getLogger().handlers)


def test_each_retry_of_a_task_is_one_warning_saying_what_failed_and_when_it_tries_again(caplog):
    from tasks.common import retry_unless_configuration

    task = SimpleNamespace(name="persist", retries=3, retry_delay_seconds=[2, 5, 10])
    with caplog.at_level(logging.WARNING, logger="vime.retry"):
        for run_count in (1, 2, 3):
            run = SimpleNamespace(name="persist-4", run_count=run_count)
            assert retry_unless_configuration(task, run, SimpleNamespace(data=ConnectionResetError("reset\nmore")))
        assert not retry_unless_configuration(task, run, SimpleNamespace(data=ValueError("bad data")))
    assert [r.getMessage() for r in caplog.records] == [
        f"persist-4 failed (ConnectionResetError: reset); try {n + 1} of 4 in {d} s"
        for n, d in zip((1, 2, 3), task.retry_delay_seconds)
    ]
