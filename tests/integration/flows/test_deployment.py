"""prefect.yaml's deployments, deployed to a real Prefect server and run by a real process
worker: the way a user schedules vime from the UI or `prefect deployment run`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from vime_core.config import VimeConfig
from vime_core.utils.processes import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

REPO = Path(__file__).resolve().parents[3]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} not up after {timeout} s")


def _stop(proc: subprocess.Popen) -> None:
    # Prefect's process worker ignores SIGTERM: kill the whole group
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture()
def prefect_server(tmp_path, new_prefect_home):
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(new_prefect_home(tmp_path / "prefect")),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "VIME_REPO_DIR": str(REPO),
    }
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/health", 120)
        yield env
    finally:
        _stop(proc)


def test_teardown_deployment_runs_through_a_process_worker(prefect_server, ray_head, tmp_path):
    env = prefect_server
    run = lambda *args, **kw: subprocess.run(
        [PREFECT, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=180, **kw
    )
    assert run("work-pool", "create", "vime-process", "--type", "process").returncode == 0
    deployed = run("--no-prompt", "deploy", "--all")
    assert deployed.returncode == 0, deployed.stdout[-2000:] + deployed.stderr[-2000:]
    listed = run("deployment", "ls").stdout
    for name in ("train/vime-train", "iteration/vime-iteration", "replay/vime-replay", "teardown/vime-teardown"):
        assert name in listed

    # the UI's parameter form comes from the configuration model's JSON schema
    with urllib.request.urlopen(
        urllib.request.Request(
            env["PREFECT_API_URL"] + "/deployments/filter", data=b"{}", headers={"content-type": "application/json"}
        )
    ) as resp:
        deployments = {d["name"]: d for d in json.load(resp)}
    schema = deployments["vime-train"]["parameter_openapi_schema"]
    fields = schema["definitions"]["VimeConfig"]["properties"]
    assert fields["rollout_batch_size"]["description"]
    assert fields["rollout_batch_size"]["default"] == VimeConfig.model_fields["rollout_batch_size"].default

    worker_log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [PREFECT, "worker", "start", "--pool", "vime-process"],
        env=env,
        cwd=REPO,
        stdout=worker_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        done = run(
            "deployment",
            "run",
            "teardown/vime-teardown",
            "--param",
            "run_name=no-such-run",
            "--param",
            f"ray_address={ray_head}",
            "--watch",
            "--watch-timeout",
            "240",
        )
        assert done.returncode == 0 and "Completed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
    finally:
        _stop(worker)
