"""A real local Ray head (loopback, four device slots) and Prefect in ephemeral mode for the
flow tests. The head is shared by the whole folder; each test uses its own run name."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    from vime_core.cluster import local_head

    # before anything in this process imports ray: it reads this at import, not at ray.init
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    temp_dir = tmp_path_factory.mktemp("ray")  # this folder's own head, not a shared one
    # device slots for the trained run, a replay trainer beside it, the 8-slot disaggregated
    # placement test, and headroom (a CI run once
    # could not place the replay group with two slots; its cause was not found)
    address = local_head.start_local_head(num_gpus=8, temp_dir=temp_dir)
    yield address
    import ray

    if ray.is_initialized():
        ray.shutdown()
    local_head.stop_local_head(temp_dir=temp_dir)
