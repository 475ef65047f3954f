"""Prefect settings vime applies in code: environment defaults for the temporary server Prefect starts
without PREFECT_API_URL (SQLite write contention makes it slow a run down; a Postgres-backed server
needs none of this), and iteration subflows without heartbeats. bench/bench_orchestration.py counts the 503s."""

from __future__ import annotations

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
