"""A real S3 server (SeaweedFS `weed mini`) for the storage tests: started once per session on
free loopback ports, stopped at the end. Each test gets its own prefix in the bucket and sees
the credentials and endpoint only inside the test (monkeypatched environment)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.integration.conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from vime_core.storage.s3_server import S3Server, start_s3_server, stop_s3_server

__all__ = ["TEST_ACCESS_KEY", "TEST_SECRET_KEY", "local_ray_head", "s3_env", "s3_server", "store_uri"]


@pytest.fixture(scope="session")
def s3_server() -> S3Server:
    data_dir = Path(tempfile.mkdtemp(prefix="vime-s3-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
        server = start_s3_server(data_dir, bucket="vime-test", timeout=60)
    try:
        yield server
    finally:
        stop_s3_server(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def s3_env(s3_server, monkeypatch) -> S3Server:
    """The environment a user sets to reach the server: endpoint + credentials (no region)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    return s3_server


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.slow)])
def store_uri(request, tmp_path) -> str:
    """A fresh, empty store: a local folder, and a prefix on the real S3 server."""
    if request.param == "local":
        return str(tmp_path / "store")
    server = request.getfixturevalue("s3_env")
    return server.storage_uri(f"t-{uuid.uuid4().hex[:12]}")


@contextmanager
def local_ray_head(num_gpus: int = 1, num_cpus: int | None = None):
    """A local Ray head of its own, started from this process's environment (its workers inherit
    the S3 endpoint and credentials set before: a user's node environment), this process
    attached to it; yields its address, stops it after."""
    import ray

    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.local_head import start_local_head, stop_local_head

    if ray.is_initialized():  # attached to an earlier test's head, whose workers lack the credentials
        ray.shutdown()
    temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    try:
        address = start_local_head(num_gpus, num_cpus=num_cpus, temp_dir=temp)
        ensure_ray(address)
        yield address
    finally:
        if ray.is_initialized():
            ray.shutdown()
        stop_local_head(temp)
        shutil.rmtree(temp, ignore_errors=True)
