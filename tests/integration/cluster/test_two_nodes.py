"""Placement across Ray nodes, on one machine: the test starts a Ray head (127.0.0.1, one device
slot and the custom resource `vime_trainer`) and a worker node joined to it (127.0.0.2, one
device slot and `vime_engine`), then runs the real train flow disaggregated (colocate=false)
with trainer_node_resource / engine_node_resource, so the trainer rank lands on the head and
the engine (a real vLLM CPU server) on the worker. The engine binds engine_bind_host=127.0.0.2
(the worker's address; loopback, so the test talks only to loopback), advertises that URL, and
the real vllm-router registers it. Weights go by gloo broadcast (the trainer's store on the head's
address, the engine's worker on the worker node's). After 2 iterations: where each actor ran, the
URL the router holds, the weights published (engine version == trainer version, log-probs checked
after each publish, one group for the whole run), and the stored batches. Last, the run goes
two iterations further while the engine's vLLM server is SIGKILLed: its replacement joins a new
broadcast group and the weight checks hold. Engine authentication is on (the default): the
engine on the worker node refuses a request without the run's token, which the engine actor and
the RolloutManager hand out through Ray.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from tests.integration.flows.test_train_flow import LOGPROB_TOLERANCE  # vLLM CPU vs the trainer, fp32

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

WORKER_IP = "127.0.0.2"


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(head address, worker state); both nodes' processes end after the module."""
    import os

    import ray

    from vime_core.cluster import local_head

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if ray.is_initialized():  # a driver of another folder's head (one pytest session)
        ray.shutdown()
    head_dir, worker_dir = tmp_path_factory.mktemp("ray-head"), tmp_path_factory.mktemp("ray-worker")
    t0 = time.monotonic()
    try:
        address = local_head.start_local_head(num_gpus=1, temp_dir=head_dir, resources={"vime_trainer": 1})
        worker = local_head.start_local_worker(
            address, worker_dir, node_ip=WORKER_IP, num_gpus=1, resources={"vime_engine": 1}, all_interfaces=True
        )
        print(f"two-node cluster up in {time.monotonic() - t0:.1f} s")
        yield address, worker
    finally:
        if ray.is_initialized():
            ray.shutdown()
        worker_pgid = (local_head.worker_running(worker_dir) or {}).get("pgid")
        local_head.stop_local_worker(worker_dir)
        local_head.stop_local_head(temp_dir=head_dir)
    # the worker node's processes are its own group's (and descendants), not the head's
    assert worker_pgid is None or local_head._head_processes(worker_pgid) == []
    assert local_head.worker_running(worker_dir) is None and local_head.head_running(head_dir) is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory, two_nodes, tiny_model_dir):
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from tests.integration.small_run import small_run_config

    address, _ = two_nodes
    cfg = small_run_config(
        run_name="two-nodes",
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=address,
        colocate=False,
        trainer_node_resource="vime_trainer",
        engine_node_resource="vime_engine",
        engine_bind_host=WORKER_IP,
        num_rollout=2,
        check_weight_update_equal=True,
        weight_transport="gloo",  # the path of CPU engines on another machine (shm needs one machine)
    )
    t0 = time.monotonic()
    try:
        summary = train(cfg)
        print(f"train flow: {time.monotonic() - t0:.1f} s")
        yield cfg, summary
    finally:
        teardown(cfg.run_name, num_trainers=1)


def _node_of(actor) -> str:
    import ray

    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()), timeout=60)


def test_trainer_and_engine_run_on_different_nodes(trained, two_nodes):
    import ray

    from vime_core.cluster import names
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach

    cfg, _ = trained
    ensure_ray(cfg.ray_address)
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    assert sorted(nodes.values()) == ["127.0.0.1", WORKER_IP]
    _, trainers = attach(cfg)
    engine = ray.get_actor(names.engine(0), namespace=names.namespace(cfg.run_name))
    assert [nodes[_node_of(a)] for a in trainers.actors] == ["127.0.0.1"]  # the head: vime_trainer
    assert nodes[_node_of(engine)] == WORKER_IP  # the worker: vime_engine


def test_engine_advertises_its_bind_address_and_the_router_registered_it(trained):
    import ray

    from vime_core.cluster import names
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach

    cfg, _ = trained
    ensure_ray(cfg.ray_address)
    manager, _ = attach(cfg)
    engine = ray.get_actor(names.engine(0), namespace=names.namespace(cfg.run_name))
    url = ray.get(engine.get_url.remote())
    host, port = url.removeprefix("http://").rsplit(":", 1)
    assert host == WORKER_IP, url
    assert ray.get(manager.engine_urls.remote()) == [url]
    assert ray.get(manager.__ray_call__.remote(lambda self: self.fleet.router.workers())) == [url]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # open to reads for the router's checks
    with pytest.raises(httpx.ConnectError):  # bound to 127.0.0.2 only, not to every address
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)


def test_the_engine_on_the_other_node_needs_the_runs_token(trained):
    import ray

    from vime_core.cluster import names
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach
    from vime_core.engines.auth import auth_headers

    cfg, _ = trained
    ensure_ray(cfg.ray_address)
    manager, _ = attach(cfg)
    engine = ray.get_actor(names.engine(0), namespace=names.namespace(cfg.run_name))
    token = ray.get(manager.engine_token.remote())
    assert token is not None and ray.get(engine.engine_token.remote()) == token  # one token, through Ray
    url = ray.get(engine.get_url.remote())
    body = {"method": "vime_weight_version"}
    for headers in ({}, {"Authorization": "Bearer not-the-run-token"}):
        assert httpx.post(f"{url}/collective_rpc", json=body, headers=headers, timeout=10).status_code == 401
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, headers=headers, timeout=10).status_code == 401
    answer = httpx.post(f"{url}/collective_rpc", json=body, headers=auth_headers(token), timeout=10)
    assert (
        answer.status_code == 200 and not httpx.get(f"{url}/is_paused", headers=auth_headers(token)).json()["is_paused"]
    )


def test_weights_published_and_batches_stored(trained):
    import ray

    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach
    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore

    cfg, summary = trained
    ensure_ray(cfg.ray_address)
    manager, trainers = attach(cfg)
    # v1 at bootstrap, one publish per iteration: 3 after the train flow, more if the engine-kill
    # test has extended the run already (the tests run in any order)
    final = 2 + trainers.rank0("state")["last_trained_rollout_id"]
    assert trainers.rank0("state")["weight_version"] == final
    assert ray.get(manager.weight_versions.remote()) == [final]
    records = [
        r for r in read_records(cfg.storage_uri, cfg.run_name) if r["rollout_id"] < cfg.num_rollout
    ]  # the train flow's
    checks = [r["weight_check"] for r in records]
    assert [c["version"] for c in checks] == [k + 2 for k in range(cfg.num_rollout)]
    assert all(c["max_abs_diff"] < LOGPROB_TOLERANCE for c in checks), checks
    # every iteration's publish was a gloo broadcast in the group formed at bootstrap (v1)
    transports = [r["publish_transport_s"] for r in records]
    assert all("broadcast_and_load" in t and "form_group" not in t for t in transports), transports
    assert summary["iterations"] == cfg.num_rollout
    store = BatchStore(cfg.storage_uri)
    for k in range(cfg.num_rollout):
        batch, lineage = store.read(cfg.run_name, k)
        assert len(batch["tokens"]) == cfg.rollout_batch_size * cfg.n_samples_per_prompt
        assert int(lineage["rollout_id"]) == k
        assert {span["version"] for spans in batch["weight_versions"] for span in spans} == {k + 1}


def test_a_killed_engine_is_replaced_and_joins_a_new_broadcast_group(trained):
    """Extends the run by two iterations, SIGKILLing the engine's vLLM server (on the
    worker node) as the first of them starts. The run goes on, the engine that replaces it is
    put in a new broadcast group (the trainer's kept group spanned a server that is gone), the
    engines hold the trainer's weights after every sync, and the store holds one trainable batch
    per rollout id (test_faults._check_run)."""
    import ray

    import tasks.rollout as rollout_task
    from flows.train import train
    from vime_core.engines.client import SyncEngineClient
    from vime_core.report.records import read_records
    from vime_core.utils.processes import pid_alive
    from tests.integration.flows.test_faults import _check_run, _engine_server_pid, _handles

    cfg, _ = trained
    manager, trainers = _handles(cfg)

    def groups() -> tuple[str, list]:
        kept = ray.get(
            trainers.actors[0].__ray_call__.remote(lambda a: a.trainer._publisher.broadcast_group("gloo").group_id)
        )
        [url] = ray.get(manager.engine_urls.remote())
        token = ray.get(manager.engine_token.remote())
        return kept, SyncEngineClient(url, token=token).collective_rpc("vime_broadcast_group_id")

    kept_before, engine_before = groups()
    assert engine_before == [kept_before]
    run = cfg.model_copy(update={"num_rollout": cfg.num_rollout + 2})
    killed: list[int] = []
    real = rollout_task.rollout.fn

    def kill_the_engine_first(config, rollout_id, version=None):
        if not killed:
            pid = _engine_server_pid(config)
            os.killpg(os.getpgid(pid), signal.SIGKILL)
            killed.append(pid)
        return real(config, rollout_id, version)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rollout_task.rollout, "fn", kill_the_engine_first)
        mp.setattr(rollout_task.rollout, "retry_delay_seconds", 0)
        summary = train(run)
    assert killed and not pid_alive(killed[0])
    assert summary["iterations"] >= 2
    kept_after, engine_after = groups()
    assert engine_after == [kept_after] and kept_after != kept_before
    checks = [r["weight_check"] for r in read_records(run.storage_uri, run.run_name)]
    assert len(checks) == run.num_rollout and all(c["max_abs_diff"] < LOGPROB_TOLERANCE for c in checks), checks
    # what was stored: one trainable batch per rollout id, sampled by that iteration's weights;
    # one optimizer step per rollout id; engine version == trainer version
    _check_run(run, run.num_rollout)
