"""A Ray task on the local head writes a batch to the real S3 server, with the credentials and
endpoint taken from the Ray node's environment only (the driver has none)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vime_core.cluster.local_head import start_local_head, stop_local_head
from vime_core.storage import BatchStore
from vime_core.storage.synthetic import synthetic_batch

REPO = Path(__file__).resolve().parents[3]

DRIVER = """
import os, sys
assert not any(k.startswith("AWS_") for k in os.environ), "the driver must not hold credentials"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)

@ray.remote(num_cpus=0)
def persist(uri):
    from vime_core.storage import BatchStore
    from vime_core.storage.synthetic import synthetic_batch
    return BatchStore(uri).write(synthetic_batch(seed=21), {"run": "from-ray", "rollout_id": 0}).key

print("KEY" + ray.get(persist.remote(sys.argv[2]), timeout=120))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_task_persists_with_node_credentials(s3_env):
    temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    uri = s3_env.storage_uri("ray-task")
    try:
        # s3_env put the endpoint and credentials in this process's environment: the head inherits them.
        address = start_local_head(1, num_cpus=1, temp_dir=temp)
        driver_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        driver_env["PYTHONPATH"] = str(REPO)
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, address, uri], env=driver_env, capture_output=True, text=True, timeout=240
        )
        line = next((l for l in run.stdout.splitlines() if l.startswith("KEY")), None)
        assert line, f"driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        batch, lineage = BatchStore(uri).read("from-ray", 0)
        assert batch == synthetic_batch(seed=21)
        assert line[len("KEY") :] == BatchStore(uri).ref("from-ray", 0).key
    finally:
        stop_local_head(temp)
        shutil.rmtree(temp, ignore_errors=True)
