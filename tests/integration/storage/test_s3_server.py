"""The SeaweedFS helper: idempotent start, status through infra/seaweedfs.sh, clear errors."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from vime_core.storage.s3_server import start_s3_server

from .conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY

REPO = Path(__file__).resolve().parents[3]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_start_is_idempotent_and_status_reports_the_endpoint(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    again = start_s3_server(s3_server.data_dir, bucket=s3_server.bucket)
    assert (again.endpoint, again.pid) == (s3_server.endpoint, s3_server.pid)
    status = subprocess.run(["bash", str(REPO / "infra" / "seaweedfs.sh"), "status", "--dir", s3_server.data_dir],
                            capture_output=True, text=True, timeout=60, env={**os.environ, "VIME_PYTHON": str(REPO / ".venv" / "bin" / "python")})
    assert status.returncode == 0 and f"AWS_ENDPOINT_URL={s3_server.endpoint}" in status.stdout
    assert s3_server.endpoint.startswith("http://127.0.0.1:")


def test_status_of_a_folder_without_server(tmp_path):
    status = subprocess.run(["bash", str(REPO / "infra" / "seaweedfs.sh"), "status", "--dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 3 and "not running" in status.stdout


def test_missing_credentials_are_named(tmp_path, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(RuntimeError, match="AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"):
        start_s3_server(tmp_path / "s3")
