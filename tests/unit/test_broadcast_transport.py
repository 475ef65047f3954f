"""The broadcast weight transport (`gloo` here; `nccl` is the same code over another carrier)
against stub engines whose workers join a real gloo group in this process: what each worker
receives, rank layout, keeping the group across publishes, forming a new one when an engine's
workers are in no group or another, and an engine that refuses a bucket. The real vLLM side is
in tests/integration/publish/test_publish_broadcast.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from vime_core.weight_sync.publish import PublishError, publish_weights
from vime_core.weight_sync.transport.broadcast import rank_offsets
from vime_core.wire.broadcast_format import GROUP_ID_RPC, BroadcastBucketInfo, BroadcastInitInfo
from vime_core.wire.broadcast_group import open_group

from tests.unit.test_publish import make_cfg, spec_of, weights


class BroadcastStubEngine:
    """An engine of `workers` workers; each joins the group as rank_offset + w and receives
    every bucket by broadcast, as `broadcast_backend` does inside vLLM."""

    def __init__(self, url: str, spec: dict, workers: int = 1, refuse_bucket: int | None = None) -> None:
        self.base_url = self.name = url
        self.spec = spec
        self.workers = workers
        self.refuse_bucket = refuse_bucket
        self.groups: list = [None] * workers
        self.group_id: str | None = None
        self.ranks: list[int] = []
        self.inits = 0
        self.buckets = 0
        self.loaded: list[dict[str, torch.Tensor]] = [{} for _ in range(workers)]
        self.version = 0

    async def collective_rpc(self, method, kwargs=None, args=None, timeout_s=None):
        if method == GROUP_ID_RPC:
            return [self.group_id] * self.workers
        return [self.spec] * self.workers

    async def init_weight_transfer(self, info):
        info = BroadcastInitInfo(**info)
        self.inits += 1
        for group in self.groups:
            if group is not None:
                group.close()
        self.ranks = [info.rank_offset + w for w in range(self.workers)]
        self.groups = await asyncio.gather(
            *(
                asyncio.to_thread(
                    open_group, info.carrier, info.rendezvous, rank, info.world_size, torch.device("cpu"), 30.0
                )
                for rank in self.ranks
            )
        )
        self.group_id = info.group_id

    async def update_weights(self, info):
        info = BroadcastBucketInfo(**info)
        self.buckets += 1
        if info.group_id != self.group_id or self.buckets == self.refuse_bucket:
            raise RuntimeError(f"{self.name} refuses bucket {self.buckets}")

        def receive(w: int) -> None:
            buffer = torch.empty(info.nbytes, dtype=torch.uint8)
            self.groups[w].broadcast(buffer)
            for name, dtype, shape, offset, size in zip(
                info.names, info.dtype_names, info.shapes, info.offsets(), info.tensor_sizes
            ):
                self.loaded[w][name] = buffer[offset : offset + size].view(getattr(torch, dtype)).view(shape).clone()

        await asyncio.gather(*(asyncio.to_thread(receive, w) for w in range(self.workers)))

    async def pause(self, mode):
        pass

    async def resume(self):
        pass

    async def reset_prefix_cache(self):
        pass

    async def start_weight_update(self):
        pass

    async def request(self, method, path, json=None, **kw):
        pass

    async def aclose(self):
        pass

    async def finish_weight_update(self, version):
        self.version = version

    async def weight_version(self):
        return self.version

    def restart(self) -> None:
        """A restarted engine: its workers are in no group."""
        for group in self.groups:
            if group is not None:
                group.close()
        self.groups, self.group_id = [None] * self.workers, None


@pytest.fixture
def publisher():
    from vime_core.weight_sync.publish_loop import PublishLoop

    loop = PublishLoop()
    yield loop
    loop.close()


def publish(w, engines, version, publisher):
    by_url = {e.name: e for e in engines}
    return publish_weights(
        w.items(),
        list(by_url),
        version,
        make_cfg(weight_transport="gloo"),
        initial_version=0,
        client_factory=by_url.__getitem__,
        loop=publisher,
    )


def assert_received(engine, w) -> None:
    for loaded in engine.loaded:  # every worker, every tensor, in the served dtype
        assert set(loaded) == set(w)
        for name, tensor in w.items():
            assert torch.equal(loaded[name], tensor.to(torch.bfloat16)), name


def test_rank_offsets_put_the_trainer_first_and_engines_in_order():
    assert rank_offsets([2, 1, 4]) == ([1, 3, 4], 8)
    with pytest.raises(ValueError, match="0 workers"):
        rank_offsets([1, 0])


def test_every_worker_of_every_engine_receives_every_tensor(publisher):
    w = weights()
    engines = [BroadcastStubEngine("http://e0", spec_of(w), workers=2), BroadcastStubEngine("http://e1", spec_of(w))]
    stats = publish(w, engines, 1, publisher)
    assert stats["transport"] == "gloo" and stats["buckets"] > 1 and "form_group" in stats["transport_seconds"]
    assert engines[0].ranks == [1, 2] and engines[1].ranks == [3]
    for engine in engines:
        assert_received(engine, w)
        assert engine.version == 1 and engine.buckets == stats["buckets"]


def test_the_group_is_kept_between_publishes_and_formed_again_when_an_engine_restarts(publisher):
    w1, w2, w3 = weights(1), weights(2), weights(3)
    engines = [BroadcastStubEngine("http://e0", spec_of(w1)), BroadcastStubEngine("http://e1", spec_of(w1))]
    publish(w1, engines, 1, publisher)
    first_group = engines[0].group_id
    packed_into = [b.data_ptr() for b in publisher.broadcast_group("gloo").host_buffers]
    stats = publish(w2, engines, 2, publisher)
    assert "form_group" not in stats["transport_seconds"]
    # on CPU the buckets are packed into the last publish's buffers
    assert [b.data_ptr() for b in publisher.broadcast_group("gloo").host_buffers] == packed_into
    assert len(packed_into) == stats["buckets"]
    assert [e.inits for e in engines] == [1, 1] and engines[1].group_id == first_group
    for engine in engines:
        assert_received(engine, w2)

    engines[1].restart()
    stats = publish(w3, engines, 3, publisher)
    assert "form_group" in stats["transport_seconds"]
    # a group spans every engine: both join the new one
    assert [e.inits for e in engines] == [2, 2] and engines[0].group_id == engines[1].group_id != first_group
    for engine in engines:
        assert_received(engine, w3)
        assert engine.version == 3


def test_a_refused_bucket_drops_the_group_and_the_next_publish_forms_one(publisher):
    # bucket 2 is one 8 MiB tensor: more than a socket buffers, so rank 0's send of it stays
    # blocked once the engine refused it, until the group is aborted (or gloo's 300 s timeout)
    w = {"model.embed_tokens.weight": torch.randn(19, 32), "model.layers.0.mlp.up_proj.weight": torch.randn(2048, 2048)}
    engine = BroadcastStubEngine("http://e0", spec_of(w), refuse_bucket=2)
    t0 = time.monotonic()
    with pytest.raises(PublishError, match="refuses bucket 2") as err:
        publish(w, [engine], 1, publisher)
    assert time.monotonic() - t0 < 60  # the blocked send did not hold the publish
    assert err.value.bytes_moved  # bucket 1 was loaded: the engine may hold a partial update
    assert publisher.broadcast_group("gloo") is None and engine.version == 0

    engine.refuse_bucket = None
    engine.restart()  # what the operator does after a partial update (or the engine is replaced)
    engine.buckets = 0
    stats = publish(w, [engine], 1, publisher)
    assert "form_group" in stats["transport_seconds"] and engine.version == 1
    assert_received(engine, w)


def test_descriptors_refuse_what_would_desynchronise_the_group():
    with pytest.raises(ValueError, match="carrier"):
        BroadcastInitInfo("tcp", {}, "g", 1, 2)
    with pytest.raises(ValueError, match="rank_offset"):
        BroadcastInitInfo("gloo", {"host": "127.0.0.1", "port": 1}, "g", 0, 2)
    with pytest.raises(ValueError, match="unique_id"):
        BroadcastInitInfo("nccl", {"host": "127.0.0.1"}, "g", 1, 2)
    with pytest.raises(ValueError, match="'w'.*descriptor says 7"):
        BroadcastBucketInfo("g", ["w"], ["bfloat16"], [[2, 2]], [7])
    assert BroadcastBucketInfo("g", ["a", "b"], ["float32", "bfloat16"], [[2], [3]], [8, 6]).offsets() == [0, 8]


def test_nccl_on_cpu_is_a_configuration_error_and_broadcast_engines_load_vime_broadcast():
    from vime_core.config import engine_server_args, weight_transport

    with pytest.raises(ValueError, match="weight_transport=nccl needs CUDA"):
        weight_transport(make_cfg(weight_transport="nccl"))
    assert engine_server_args(make_cfg(weight_transport="gloo"))["weight_transfer_config"] == {
        "backend": "vime_broadcast"
    }
    with pytest.raises(ValueError, match="colocated engines take ipc"):
        weight_transport(make_cfg(weight_transport="nccl", device="cuda", colocate=True))
    assert weight_transport(make_cfg(weight_transport="nccl", device="cuda", colocate=False)) == "nccl"
    assert weight_transport(make_cfg(device="cuda", colocate=False)) == "nccl"  # auto, engines elsewhere


def test_a_missing_nccl_library_is_named(monkeypatch):
    from vime_core.wire.broadcast_group import nccl_library

    monkeypatch.setenv("VIME_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    with pytest.raises(RuntimeError, match="VIME_NCCL_LIBRARY.*/nonexistent/libnccl.so.2"):
        nccl_library()


class _JoiningNccl:
    """ncclCommInitRank as NCCL runs it: it returns once every rank has joined (`joined` set),
    writing the communicator; ncclCommDestroy records what it destroyed."""

    def __init__(self) -> None:
        import threading

        self.joined = threading.Event()
        self.destroyed: list[int] = []

    def ncclCommInitRank(self, comm_ref, world_size, uid, rank) -> int:
        self.joined.wait()
        comm_ref._obj.value = 1234
        return 0

    def ncclCommDestroy(self, comm) -> int:
        self.destroyed.append(comm.value)
        return 0

    def ncclGetErrorString(self, code) -> bytes:
        return b"unhandled"


def test_nccl_init_gives_up_when_a_peer_never_joins_and_destroys_a_late_communicator():
    """NCCL's init has no timeout: a peer that never joins must not hang the worker or the
    trainer. The real library's run on a GPU: bench/gpu/check_nccl_group.py --init-timeout."""
    from vime_core.wire.broadcast_group import _UniqueId, init_comm_with_deadline

    lib = _JoiningNccl()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 of 2\) did not complete in 0 s: not every rank joined"):
        init_comm_with_deadline(lib, 2, _UniqueId(), 0, torch.device("cpu"), 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    lib.joined.set()  # the peer comes after all: its communicator is not kept by anyone
    deadline = time.monotonic() + 5
    while not lib.destroyed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lib.destroyed == [1234]

    joined = _JoiningNccl()
    joined.joined.set()
    assert init_comm_with_deadline(joined, 2, _UniqueId(), 1, torch.device("cpu"), 5).value == 1234
    assert joined.destroyed == []
