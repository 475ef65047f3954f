"""The placement plan: which bundles trainer ranks and engines get, and which device ids each
engine's server receives (colocated and disaggregated), without Ray."""

from __future__ import annotations

import pytest

from vime_core.cluster.placement import (
    NODE_RESOURCE_SHARE,
    BundleDevice,
    bundle_resources,
    PlacementPlan,
    one_engine_devices,
    plan_placement,
)


def _devices(n: int, nodes: int = 1) -> list[BundleDevice]:
    per_node = n // nodes
    return [BundleDevice(f"10.0.0.{b // per_node}", str(b % per_node)) for b in range(n)]


def engine_devices(plan: PlacementPlan, bundles: list[BundleDevice]) -> list[tuple[str, list[str]]]:
    """Each engine's (node, device ids) as its actor finds them (run_actors.EngineDevices), when Ray
    assigned `bundles` to the plan's bundles."""
    return [one_engine_devices(e, ids, [bundles[b] for b in ids]) for e, ids in enumerate(plan.engine_bundles)]


def test_colocated_engines_share_the_devices_of_their_trainer_ranks():
    # 4 device slots: trainer TP=2 x DP=2, two engines of TP=2
    plan = plan_placement(trainer_devices=4, rollout_devices=4, devices_per_engine=2, colocate=True)
    assert plan.num_bundles == 4 and plan.trainer_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[0, 1], [2, 3]]
    assert plan.trainer_share + plan.engine_share <= 1.0
    devices = engine_devices(plan, _devices(4))
    assert devices == [("10.0.0.0", ["0", "1"]), ("10.0.0.0", ["2", "3"])]


def test_disaggregated_engines_get_their_own_devices():
    plan = plan_placement(trainer_devices=4, rollout_devices=4, devices_per_engine=2, colocate=False)
    assert plan.num_bundles == 8 and plan.trainer_bundles == [0, 1, 2, 3]
    assert plan.engine_bundles == [[4, 5], [6, 7]] and plan.trainer_share == 1.0
    devices = engine_devices(plan, _devices(8))
    assert [ids for _, ids in devices] == [["4", "5"], ["6", "7"]]


def test_an_engine_split_across_nodes_is_refused():
    plan = plan_placement(trainer_devices=2, rollout_devices=2, devices_per_engine=2, colocate=True)
    with pytest.raises(RuntimeError, match="several nodes"):
        engine_devices(plan, _devices(2, nodes=2))
    with pytest.raises(ValueError, match="equal to the trainer"):
        plan_placement(trainer_devices=2, rollout_devices=4, devices_per_engine=2, colocate=True)


def test_node_resources_pin_each_side_to_its_nodes():
    plan = plan_placement(trainer_devices=2, rollout_devices=2, devices_per_engine=1, colocate=False)
    assert bundle_resources(plan) == [{"GPU": 1}] * 4  # the default: any node with devices
    share = NODE_RESOURCE_SHARE
    assert bundle_resources(plan, "trainers", "engines") == [
        {"GPU": 1, "trainers": share},
        {"GPU": 1, "trainers": share},
        {"GPU": 1, "engines": share},
        {"GPU": 1, "engines": share},
    ]
    assert bundle_resources(plan, engine_resource="engines")[:2] == [{"GPU": 1}] * 2
    colocated = plan_placement(trainer_devices=2, rollout_devices=2, devices_per_engine=1, colocate=True)
    assert bundle_resources(colocated, "trainers", "engines") == [{"GPU": 1, "trainers": share, "engines": share}] * 2


def test_engine_command_follows_the_vllm_release_and_gets_its_devices(tiny_model_dir):
    from vime_core.config import make_config
    from vime_core.engines.server import VIME_WORKER_EXTENSION, EngineServer
    from vime_core.engines.vllm_api import VllmApi

    cfg = make_config(
        {
            "hf_checkpoint": str(tiny_model_dir),
            "device": "cuda",
            "bf16": True,
            "weight_transport": "ipc",
            "engine_bind_host": "0.0.0.0",
        }
    )
    old = EngineServer(cfg, 0, device_ids=["2", "3"], api=VllmApi.for_version("0.26.0"))
    cmd = old.command(4321)
    assert "--enable-scale-out" not in cmd and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16" and "--gpu-memory-utilization" in cmd
    assert cmd[cmd.index("--worker-extension-cls") + 1] == VIME_WORKER_EXTENSION
    assert '"backend": "ipc"' in cmd[cmd.index("--weight-transfer-config") + 1]
    assert old.environment()["CUDA_VISIBLE_DEVICES"] == "2,3"
    new = EngineServer(cfg, 0, api=VllmApi.for_version("0.32.0"))
    assert "--enable-scale-out" in new.command(4321)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--api-server-count" not in cmd
    # opt-in: the model class inspected in the API server's process, through vime's wrapper of it
    inspecting = cfg.model_copy(update={"vllm_env": ["VIME_VLLM_INSPECT_IN_PROCESS=1"]})
    cmd = EngineServer(inspecting, 0, api=VllmApi.for_version("0.26.0")).command(4321)
    assert cmd[1:3] == ["-m", "vime_core.engines.vllm_side.api_server"]


def test_several_front_ends_go_through_vllm_serve(tiny_model_dir):
    from vime_core.config import make_config
    from vime_core.engines.server import EngineServer
    from vime_core.engines.vllm_api import VllmApi

    cfg = make_config({"hf_checkpoint": str(tiny_model_dir), "vllm_api_server_count": 4})
    cmd = EngineServer(cfg, 0, api=VllmApi.for_version("0.32.0")).command(4321)
    assert cmd[1:6] == ["-m", "vime_core.engines.vllm_side.serve_cli", "serve", "--api-server-count", "4"]
    assert cmd[cmd.index("--model") + 1] == str(tiny_model_dir.resolve()) and cmd[cmd.index("--port") + 1] == "4321"
    with pytest.raises(ValueError, match="vllm_api_server_count"):
        make_config({"vllm_api_server_count": 0})


def test_an_engine_refuses_to_start_without_the_memory_it_is_set_to_take(tiny_model_dir, monkeypatch, tmp_path):
    """Before launching: the error names vllm_gpu_memory_utilization and the free memory seen;
    no server process is started."""
    from vime_core.config import make_config
    from vime_core.engines.server import DeviceMemoryError, EngineServer
    from vime_core.engines.vllm_api import VllmApi
    from vime_core.utils import device_memory

    gib = 2**30
    monkeypatch.setattr(
        device_memory, "_query", lambda args: [["0", str(140 * 1024), str(100 * 1024)], ["1", str(140 * 1024), "0"]]
    )
    cfg = make_config({"hf_checkpoint": str(tiny_model_dir), "device": "cuda", "vllm_gpu_memory_utilization": 0.5})
    server = EngineServer(cfg, 0, device_ids=["0"], api=VllmApi.for_version("0.26.0"), log_dir=str(tmp_path))
    with pytest.raises(
        DeviceMemoryError, match=r"vllm_gpu_memory_utilization=0.5 .* device 0: 40.0 GiB free of 140.0 GiB"
    ):
        server.start()
    assert server._proc is None and not list(tmp_path.iterdir())
    assert device_memory.free_and_total(["1"]) == {"1": (140 * gib, 140 * gib)}


def test_vllm_env_reaches_the_engine_and_cannot_touch_what_vime_sets(tiny_model_dir, monkeypatch):
    import os

    from vime_core.config import make_config
    from vime_core.config.derive import ENGINE_DEFAULT_ENV, ENGINE_MANAGED_ENV
    from vime_core.engines.server import EngineServer

    base = {"hf_checkpoint": str(tiny_model_dir), "device": "cuda", "bf16": True, "weight_transport": "ipc"}
    cfg = make_config({**base, "vllm_env": ["VLLM_WORKER_MULTIPROC_METHOD=fork", "TRITON_CACHE_DIR=/x=y"]})
    env = EngineServer(cfg, 0, device_ids=["1"]).environment()
    assert (env["VLLM_WORKER_MULTIPROC_METHOD"], env["TRITON_CACHE_DIR"]) == ("fork", "/x=y")  # split at the first '='
    # every variable the server sets over its actor's environment is one vllm_env may not set, or
    # a default that vllm_env (above) replaces
    servers = [
        EngineServer(make_config(base), 0, device_ids=["0"]),
        EngineServer(make_config({**base, "device": "cpu", "bf16": False, "weight_transport": "shm"}), 0),
    ]
    monkeypatch.setattr(os, "environ", {"PATH": os.environ.get("PATH", "")})  # the actor's own: PATH only
    for server in servers:
        added = set(server.environment()) - {"PATH"}
        assert added <= ENGINE_MANAGED_ENV | ENGINE_DEFAULT_ENV, added - ENGINE_MANAGED_ENV - ENGINE_DEFAULT_ENV
    for entries, needle in (
        ([["CUDA_VISIBLE_DEVICES=0"]], "vllm_env sets CUDA_VISIBLE_DEVICES"),
        ([["HF_TOKEN=hf_abc123"]], "vllm_env names HF_TOKEN, which looks like a secret"),
        ([["VLLM_API_KEY=sk-1"]], "looks like a secret"),
        ([["nonsense sk-hidden"]], "vllm_env entry 0 is not NAME=VALUE"),
    ):
        with pytest.raises(ValueError, match=needle) as raised:
            make_config({**base, "vllm_env": entries[0]})
        assert "abc123" not in str(raised.value) and "sk-" not in str(raised.value)  # no value in the error
