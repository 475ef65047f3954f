"""Fixtures of every integration folder.

- `ray_head`: one real local Ray head (loopback, eight device slots) for the session, shared by
  the whole runs of tests/integration/flows and storage (each run has its own run name and tears
  its actors down). Its workers hold the test S3 server's credentials and no endpoint, as a
  user's nodes do: a run on S3 names its endpoint in its configuration.
- `new_prefect_home`: a fresh Prefect home for each `vime train` (or Prefect server) a test starts
  in a process of its own, its database already at the installed Prefect's schema. A server on an
  empty home runs every migration before it answers (seconds of CPU at each start); a copy of
  one migrated database gives the same empty database without them.
- `session_prefect_api`: the API of this process's own Prefect temporary server, for a `vime
  train` a test starts whose Prefect server need not die with it: that process then starts no
  temporary server of its own (seconds of CPU at each start)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest

from vime_core.storage.endpoint import ENDPOINT_ENV

# Made-up test credentials; the test S3 servers (tests/integration/storage) accept exactly these.
TEST_ACCESS_KEY = "vimetestaccesskey"
TEST_SECRET_KEY = "vime-test-secret-" + uuid.uuid4().hex

PREFECT_DB = "prefect.db"  # where Prefect keeps its SQLite database under PREFECT_HOME, by default
PREFECT_CLI = str(Path(sys.executable).with_name("prefect"))


@pytest.fixture(scope="session")
def migrated_prefect_db(cache_dir) -> Path:
    """An empty Prefect database at the installed Prefect's schema head (`prefect server database
    upgrade`), built once and kept across sessions under the Prefect version that built it."""
    import prefect

    path = cache_dir / "prefect" / prefect.__version__ / PREFECT_DB
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(prefix="build-", dir=path.parent))
    try:
        env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_DATABASE_CONNECTION_URL"}
        done = subprocess.run(
            [PREFECT_CLI, "server", "database", "upgrade", "-y"],
            env={**env, "PREFECT_HOME": str(build)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, f"prefect server database upgrade failed:\n{done.stderr[-3000:]}"
        os.replace(build / PREFECT_DB, path)  # whole or absent for a session beside this one
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return path


@pytest.fixture(scope="session")
def new_prefect_home(migrated_prefect_db):
    """`new_prefect_home(folder)`: `folder` made a Prefect home of its own (PREFECT_HOME) holding a
    copy of the migrated empty database; returns it. Nothing is shared between homes."""

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(migrated_prefect_db, folder / PREFECT_DB)
        return folder

    return make


@pytest.fixture(scope="session")
def session_prefect_api() -> str:
    """PREFECT_API_URL of the server this process's flow runs use: the one PREFECT_API_URL names,
    else Prefect's temporary server (ephemeral mode, with flows/settings' defaults:
    tests/conftest.py), started here if no flow ran yet; it ends with this process."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return PREFECT_API_URL.value()
    server = SubprocessASGIServer()  # the instance Prefect's client starts without PREFECT_API_URL
    server.start()
    return server.api_url


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    from vime_core.cluster import local_head

    # before anything in this process imports ray: it reads this at import, not at ray.init
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    temp_dir = tmp_path_factory.mktemp("ray")  # this session's own head, not a shared one
    # device slots for the trained run, a replay trainer beside it, the 8-slot disaggregated
    # placement test, and headroom (a CI run once could not place the replay group with two
    # slots; its cause was not found)
    with pytest.MonkeyPatch.context() as mp:  # the head's processes and its workers inherit this
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", *ENDPOINT_ENV):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
        address = local_head.start_local_head(num_gpus=8, temp_dir=temp_dir)
    yield address
    import ray

    if ray.is_initialized():
        ray.shutdown()
    local_head.stop_local_head(temp_dir=temp_dir)
