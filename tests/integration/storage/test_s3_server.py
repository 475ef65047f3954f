"""The SeaweedFS helper: idempotent start, status through infra/seaweedfs.sh, clear errors."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from vime_core.storage import s3_server as s3_module
from vime_core.storage.s3_server import START_ATTEMPTS, start_s3_server, stop_s3_server

from .conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_start_is_idempotent_and_status_reports_the_endpoint(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    again = start_s3_server(s3_server.data_dir, bucket=s3_server.bucket)
    assert (again.endpoint, again.pid) == (s3_server.endpoint, s3_server.pid)
    status = subprocess.run(
        ["bash", str(REPO / "infra" / "seaweedfs.sh"), "status", "--dir", s3_server.data_dir],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "VIME_PYTHON": str(REPO / ".venv" / "bin" / "python")},
    )
    assert status.returncode == 0 and f"AWS_ENDPOINT_URL={s3_server.endpoint}" in status.stdout
    assert s3_server.endpoint.startswith("http://127.0.0.1:")


def test_status_of_a_folder_without_server(tmp_path):
    status = subprocess.run(
        ["bash", str(REPO / "infra" / "seaweedfs.sh"), "status", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 3 and "not running" in status.stdout


def test_missing_credentials_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(RuntimeError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        start_s3_server(tmp_path / "s3")


@pytest.fixture
def held_port():
    """A loopback port another process holds (listening), as when one picked as free is taken."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


def _credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)


def _first_pick_taken(monkeypatch, held_port: int, starts: int) -> list:
    """Make the first port picked (master.port) by each of the first `starts` launches the held
    one; return the list of (process, server) of every launch."""
    launched, taken_next = [], []
    real_launch, real_free_port = s3_module._launch, s3_module.free_port

    def launch(*args):
        taken_next[:] = [len(launched) < starts]
        launched.append(real_launch(*args))
        return launched[-1]

    def free_port() -> int:
        return held_port if taken_next and taken_next.pop() else real_free_port()

    monkeypatch.setattr(s3_module, "_launch", launch)
    monkeypatch.setattr(s3_module, "free_port", free_port)
    return launched


def test_a_port_taken_between_pick_and_bind_is_picked_again(tmp_path, monkeypatch, held_port):
    _credentials(monkeypatch)
    launched = _first_pick_taken(monkeypatch, held_port, starts=1)
    server = start_s3_server(tmp_path / "s3", bucket="retry")
    try:
        assert s3_module._ready(server.endpoint, "retry")
        assert s3_module.server_status(tmp_path / "s3").pid == server.pid
        assert f"port {held_port}" in (tmp_path / "s3" / "weed.log").read_text()
        (first, _), (second, _) = launched
        assert first.returncode is not None and second.pid == server.pid
    finally:
        stop_s3_server(tmp_path / "s3")


def test_a_server_that_never_starts_names_its_exit_and_log(tmp_path, monkeypatch, held_port):
    _credentials(monkeypatch)
    launched = _first_pick_taken(monkeypatch, held_port, starts=START_ATTEMPTS)
    with pytest.raises(
        RuntimeError, match=f"(?s)on each of {START_ATTEMPTS} starts; .*weed.log ends with:.*port {held_port}"
    ):
        start_s3_server(tmp_path / "s3")
    assert len(launched) == START_ATTEMPTS and all(process.returncode is not None for process, _ in launched)
    assert s3_module.server_status(tmp_path / "s3") is None
    assert not (tmp_path / "s3" / s3_module.STATE_FILE).exists()


def test_a_bucket_name_s3_refuses_is_named_at_once(tmp_path, monkeypatch):
    _credentials(monkeypatch)
    for bucket in ("b", "Vime", "-vime", "x" * 64):
        with pytest.raises(ValueError, match=f"bucket {bucket!r}: S3 bucket names are 3 to 63"):
            start_s3_server(tmp_path / "s3", bucket=bucket)
    assert not (tmp_path / "s3").exists()  # refused before anything was made
