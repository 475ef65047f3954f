"""Fixtures of every integration folder.

- `ray_head`: one real local Ray head (loopback, eight device slots) for the session, shared by
  the whole runs of tests/integration/flows and storage (each run has its own run name and tears
  its actors down). Its workers hold the test S3 server's credentials and no endpoint, as a
  user's nodes do: a run on S3 names its endpoint in its configuration."""

from __future__ import annotations

import os
import uuid

import pytest

from vime_core.storage.endpoint import ENDPOINT_ENV

# Made-up test credentials; the test S3 servers (tests/integration/storage) accept exactly these.
TEST_ACCESS_KEY = "vimetestaccesskey"
TEST_SECRET_KEY = "vime-test-secret-" + uuid.uuid4().hex


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
