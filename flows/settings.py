"""Prefect settings vime applies in code: environment defaults for the temporary server Prefect starts
without PREFECT_API_URL (SQLite write contention makes it slow a run down; a Postgres-backed server
needs none of this), iteration subflows without heartbeats, and the runs' INFO lines sent to the UI
while the console keeps its level. bench/bench_orchestration.py counts the 503s and times the logs."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

SERVER_ENV_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    # no network here, and no reason to send any from a training job
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # The temporary server's own log lines reach the run's console (it inherits it). Stopped at
    # the run's end, its task-run recorder logs the batch it had not flushed (the events batched
    # above) as an error with a page of traceback. Those lines are the server's, not the
    # run's: only its critical ones stay; a flow or task that fails still says why in its own line.
    "PREFECT_SERVER_LOGGING_LEVEL": "CRITICAL",
}


def apply_env_defaults() -> None:
    """Set SERVER_ENV_DEFAULTS in os.environ where unset. Call it before the process's first
    flow run: Prefect's temporary server takes the environment when it starts (the settings
    Prefect read at import are only those set then, so a later call still reaches it).

    A value already in the environment wins. A deployment's flow run talks to a `prefect server start`
    that reads its own environment: the defaults go there. A subflow's insert that collides with
    another SQLite writer gets a 503 and a fixed client back-off; the colliding writers are the task-run
    recorder (batched here: the UI shows task states a little later) and the event persister (off here:
    only the UI's event feed stays empty; PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=true keeps it)."""
    for key, value in SERVER_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextmanager
def without_heartbeats():
    """A flow run's heartbeat thread sleeps in steps and is joined when the run ends, so every flow run
    waits for it at exit; iteration subflows run without one (the train flow keeps its own, so the UI
    still detects a crashed run). The setting takes no "off" value from the environment, only from code."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


# Prefect's loggers of flow and task runs: get_run_logger() hands out their children
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")


class _BelowConsoleLevel(logging.Filter):
    """Drops a flow or task run's record below the console's level (the records of every other logger pass)."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or not record.name.startswith(RUN_LOGGERS)


def send_run_logs() -> None:
    """A flow or task run's INFO lines (an iteration's console and ledger lines, bootstrap's marks, a
    publish's summary) reach Prefect's API, so each flow run's page in the UI holds its story; the
    console keeps PREFECT_LOGGING_LEVEL (WARNING in infra/env.sh), as vime prints its own lines.

    Prefect's run loggers take their level from the `prefect` logger (PREFECT_LOGGING_LEVEL) and
    propagate to the root's console handler. Here they log from INFO and the console handlers drop
    their records below the `prefect` logger's level. Idempotent; call it as a flow starts (Prefect
    configures logging when it is imported, and again in a process a deployment starts)."""
    console = logging.getLogger("prefect").getEffectiveLevel()
    if console <= logging.INFO:
        return  # the console shows INFO already: the run loggers inherit it
    for name in RUN_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _BelowConsoleLevel) for f in handler.filters):
            handler.addFilter(_BelowConsoleLevel(console))
