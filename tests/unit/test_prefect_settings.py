"""Prefect server defaults vime applies before Prefect's temporary server starts: by the entry
point (`vime`'s main), never by importing the flows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
BATCH = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE"


def _env_after(extra: dict) -> dict:
    """BATCH after importing the flow package and the CLI, then after `vime`'s main ran."""
    env = {k: v for k, v in os.environ.items() if k != BATCH}
    env.update(extra, PYTHONPATH=str(REPO))
    code = (
        f"import json, os, flows, flows.cli; imported = os.environ.get({BATCH!r}); "
        f"flows.cli.main(['--help']); print(json.dumps([imported, os.environ.get({BATCH!r})]))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    imported, after_main = json.loads(out.strip().splitlines()[-1])
    return {"imported": imported, "after_main": after_main}


def test_vimes_main_batches_the_task_run_recorder_and_importing_the_flows_changes_nothing():
    from flows.settings import SERVER_ENV_DEFAULTS

    assert _env_after({}) == {"imported": None, "after_main": SERVER_ENV_DEFAULTS[BATCH]}
    assert int(SERVER_ENV_DEFAULTS[BATCH]) > 1  # 1 is Prefect's default: one SQLite transaction per event
    assert SERVER_ENV_DEFAULTS["PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED"] == "false"


def test_a_value_already_in_the_environment_wins():
    assert _env_after({BATCH: "7"}) == {"imported": "7", "after_main": "7"}


def test_the_temporary_servers_own_errors_stay_off_the_console_and_the_runs_do_not():
    """With the defaults applied, Prefect's logging configuration (which its temporary server
    loads too) drops the server's error lines, such as the recorder's flush cancelled at its stop,
    and keeps the flow and task runs' warnings."""
    code = (
        "import json, logging, flows.cli; flows.cli.main(['--help']); "
        "from prefect.logging.configuration import setup_logging; setup_logging(incremental=False); "
        "print(json.dumps([logging.getLogger(n).isEnabledFor(logging.ERROR) for n in "
        "('prefect.server.services.task_run_recorder', 'uvicorn.error', 'prefect.flow_runs', 'prefect.task_runs')]))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_LOGGING_LEVEL"}
    env.update(PYTHONPATH=str(REPO), PREFECT_LOGGING_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [False, False, True, True]


def _console_after_send_run_logs(level: str) -> str:
    """stderr of a process that calls send_run_logs under PREFECT_LOGGING_LEVEL=level, then logs
    from a task run's logger at INFO and WARNING and from another logger at WARNING."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PREFECT_LOGGING_LEVEL=level, PREFECT_LOGGING_TO_API_ENABLED="false")
    code = (
        "import logging; from prefect import flow; from flows.settings import send_run_logs; "
        "send_run_logs(); send_run_logs(); "
        "run = logging.getLogger('prefect.task_runs'); "
        "assert run.getEffectiveLevel() == logging.INFO, run.getEffectiveLevel(); "
        "extra = {'task_run_name': 'report-0'}; "  # what get_run_logger() adds, and the console's format needs
        "run.info('run-info-line', extra=extra); run.warning('run-warning-line', extra=extra); "
        "logging.getLogger('prefect.other').warning('other-warning-line')"
    )
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stderr


def test_run_loggers_log_info_for_the_ui_while_the_console_keeps_its_level():
    quiet = _console_after_send_run_logs("WARNING")
    assert "run-info-line" not in quiet
    assert quiet.count("run-warning-line") == 1 and "other-warning-line" in quiet
    assert "Logging error" not in quiet
    # a console asked for INFO shows the run's INFO lines as before
    assert "run-info-line" in _console_after_send_run_logs("INFO")
