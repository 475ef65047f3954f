"""A real local Ray head (loopback, one device slot) and Prefect in ephemeral mode for the
flow tests. The head is shared by the whole folder; each test uses its own run name."""

from __future__ import annotations

import os
import uuid

import pytest


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    from vime_core.cluster import local_head

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    temp_dir = tmp_path_factory.mktemp("ray")  # this folder's own head, not a shared one
    # two device slots: the trained run holds one, a replay trainer takes the other
    address = local_head.start_local_head(num_gpus=2, temp_dir=temp_dir)
    yield address
    import ray

    if ray.is_initialized():
        ray.shutdown()
    local_head.stop_local_head(temp_dir=temp_dir)


@pytest.fixture()
def small_config(tmp_path, ray_head, tiny_model_dir):
    """The default job, shrunk: 4 prompts x 4 samples, 3 iterations, a checkpoint each."""
    from vime_core.config import VimeConfig

    return VimeConfig(
        run_name=f"t-{uuid.uuid4().hex[:8]}",
        storage_uri=str(tmp_path / "store"),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=3,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        micro_batch_size=8,
        save_interval=1,
        vllm_server_concurrency=64,
    )


@pytest.fixture()
def teardown_run():
    """Removes the runs a test created, even when it fails."""
    runs = []
    yield runs.append
    from vime_core.cluster.run_actors import teardown

    for cfg in runs:
        try:
            teardown(cfg.run_name)
        except Exception:  # a test that failed before Ray came up
            pass
