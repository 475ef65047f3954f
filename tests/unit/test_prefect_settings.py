"""Prefect server defaults vime applies before Prefect's temporary server starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BATCH = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"


def _env_after_import(extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k != BATCH}
    env.update(extra, PYTHONPATH=str(REPO))
    code = f"import os, flows; print(os.environ.get({BATCH!r}))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.strip()


def test_importing_flows_batches_the_task_run_recorder_and_turns_the_event_persister_off():
    from flows.settings import SERVER_ENV_DEFAULTS

    assert _env_after_import({}) == SERVER_ENV_DEFAULTS[BATCH]
    assert int(SERVER_ENV_DEFAULTS[BATCH]) > 1  # 1 is Prefect's default: one SQLite transaction per event
    assert SERVER_ENV_DEFAULTS["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] == "false"


def test_a_value_already_in_the_environment_wins():
    assert _env_after_import({BATCH: "7"}) == "7"
