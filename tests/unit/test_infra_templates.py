"""The multi-node templates stay loadable and consistent with the pinned environment."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"


def test_raycluster_manifest_matches_the_installed_ray_and_asks_for_gpus():
    spec = yaml.safe_load((INFRA / "k8s" / "raycluster.yaml").read_text())
    assert spec["kind"] == "RayCluster"
    assert spec["spec"]["rayVersion"] == version("ray")
    workers = spec["spec"]["workerGroupSpecs"]
    container = workers[0]["template"]["spec"]["containers"][0]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus > 0 and int(workers[0]["rayStartParams"]["num-gpus"]) == gpus
    env = {e["name"]: e for e in container["env"]}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "secretKeyRef" in env[name]["valueFrom"] and "value" not in env[name]


def test_cluster_launcher_template_is_not_loopback():
    text = (INFRA / "ray_cluster.yaml").read_text()
    config = yaml.safe_load(text)
    commands = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "--head" in commands and "--address=" in commands
    assert "127.0.0.1" not in commands and "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in commands
