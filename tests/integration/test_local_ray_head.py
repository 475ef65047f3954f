"""The local Ray head on loopback: start (idempotent), a driver with device slots and a
fractional-GPU detached actor, stop (every process it started ends)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vime_core.cluster.local_head import _head_processes, head_running, start_local_head, stop_local_head
from vime_core.utils.processes import pid_alive

REPO = Path(__file__).resolve().parents[2]
NUM_GPUS = 2

DRIVER = """
import json, os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
pg = placement_group([{"GPU": 1}] * int(sys.argv[2]), lifetime="detached")  # outlives this driver, like a run's
ray.get(pg.ready(), timeout=60)

@ray.remote(num_gpus=0.5, num_cpus=0)
class Probe:
    def where(self):
        return {"ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

# Colocation as vime does it: a fractional-GPU actor inside a bundle of the placement group.
strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0)
probe = Probe.options(name="probe", namespace="vime-test", lifetime="detached", scheduling_strategy=strategy).remote()
out = ray.get(probe.where.remote(), timeout=60)
out["gpus"] = ray.cluster_resources().get("GPU")
out["nodes"] = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_local_head_start_attach_stop():
    # Short path: Ray puts Unix sockets under the temp dir (~107-byte limit).
    temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))
    try:
        address = start_local_head(NUM_GPUS, num_cpus=1, temp_dir=temp)
        assert address.startswith("127.0.0.1:")
        assert head_running(temp) == address
        assert start_local_head(NUM_GPUS, num_cpus=1, temp_dir=temp) == address  # idempotent
        pgid = json.loads((temp / "vime_head.json").read_text())["pgid"]

        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = subprocess.run(
            [sys.executable, "-c", DRIVER, address, str(NUM_GPUS)], env=env, capture_output=True, text=True, timeout=180
        )
        line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT")), None)
        assert line, f"driver failed:\n{run.stdout[-2000:]}\n{run.stderr[-2000:]}"
        result = json.loads(line[len("RESULT") :])
        assert result["gpus"] == NUM_GPUS
        assert result["ip"] == "127.0.0.1" and result["nodes"] == ["127.0.0.1"]
        actor_pid = result["pid"]
        assert actor_pid in _head_processes(pgid), "the detached actor's worker is not counted as the head's"

        assert stop_local_head(temp)
        assert head_running(temp) is None
        assert _head_processes(pgid) == [], [
            Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in _head_processes(pgid)
        ]
        assert not pid_alive(actor_pid), "the actor's worker survived stop"
        assert not stop_local_head(temp)
    finally:
        stop_local_head(temp)
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_head_script_status_without_head(tmp_path):
    status = subprocess.run(
        ["bash", str(REPO / "infra" / "ray_head.sh"), "status", "--temp-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 3 and "not running" in status.stdout
