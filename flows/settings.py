"""Prefect settings vime applies in code.

Server (environment defaults, applied when `flows` is imported, before Prefect starts its
temporary server; a value already in the environment wins): Prefect's task-run recorder writes
every task-run event in its own SQLite transaction by default (batch size 1). The parent flow's
POST of the next iteration's tracking task then collides with those writes, SQLite answers
"database is locked", the API returns 503 and the client retries after a fixed 2 s back-off:
measured 11 of 12 iteration subflows hit it (2.35 s per subflow of 9 no-op tasks vs 0.21 s with
batched writes; bench/bench_orchestration.py). Batching the recorder's writes (flushed every
5 s and at shutdown) removes the collisions; the UI shows task states up to 5 s later. On a
Postgres-backed server none of this applies.

Heartbeats: a flow run's heartbeat thread sleeps in 1-second steps and is joined when the run
ends, so every flow run waits up to ~1 s at exit (measured: 1.3 s vs 0.33 s per empty subflow
run on the CPU machine). The train flow keeps its heartbeat (the UI still detects a crashed
run); its iteration subflows run without one. The setting accepts no "off" value from the
environment, only from code.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

SERVER_ENV_DEFAULTS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "5",
    # the event persister is the other writer: by default a transaction per 20 events, which
    # still hit about one subflow in two with a 503 (probe: 20-task subflows, 8 of 8 clean after)
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "1000",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "5",
    # no network here, and no reason to send any from a training job
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def apply_env_defaults() -> None:
    for key, value in SERVER_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextmanager
def without_heartbeats():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield
