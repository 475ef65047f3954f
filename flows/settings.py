"""Prefect settings vime applies in code.

Server (environment defaults, applied when `flows` is imported, before Prefect starts its
temporary server; a value already in the environment wins). Prefect's temporary server keeps
its state in SQLite. Creating a subflow's tracking task run reads and then writes in one
transaction; when another writer commits in between, SQLite answers "database is locked", the
API returns 503 and the client retries after a fixed 2 s back-off, which the iteration loop
waits out. Two writers collide with it:
- the task-run recorder writes every task-run event in its own transaction by default (batch
  size 1): measured 11 of 12 iteration subflows hit a 503 (2.35 s per subflow of 9 no-op tasks
  vs 0.21 s). Batched (flushed every 5 s and at shutdown), the UI shows task states up to 5 s
  later.
- the event persister (the store behind the UI's event feed): with the recorder batched, 7 503s
  in 150 iteration-like subflows (5 tasks, one of them concurrent, and a table artifact each;
  4 in the 60 iterations of a default job), 1 with the persister off; batching it differently
  (a 30 s flush: 8) or turning automations' triggers off (9) did not help. It is off on the
  temporary server: flow runs, task runs, logs and artifacts are all still recorded, only the
  event feed stays empty. Set PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED=true to keep it.
On a Postgres-backed server none of this applies.

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
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
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
