"""CUDA IPC from every trainer rank (vime_core/weight_sync/transport/ipc_peers.py), with two real
ranks (processes in a gloo group) on CPU: rank 0 publishes to a stub engine through
IpcTransport, rank 1 follows; the "handle" of a rank is a copy of its buffer and its GPU UUID a
name, so the engine can check what each GPU's worker would read, and an engine worker on a GPU
no rank publishes from is refused. The real two-GPU run needs two GPUs.
"""

from __future__ import annotations

import base64
import pickle
import traceback
import weakref

import pytest
import torch
import torch.multiprocessing as mp

from vime_core.utils.processes import free_port
from vime_core.wire.ipc_format import DEVICE_UUID_RPC

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(19, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def _copy_as_handle(buffer: torch.Tensor) -> tuple:
    return ("bytes", buffer.clone())


class HandleCounter:
    """`_copy_as_handle` that also counts, at each bucket it hands out, the earlier buckets'
    buffers the rank still holds (weak references: a live one is held by the publish)."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.held_earlier: list[int] = []

    def __call__(self, buffer: torch.Tensor) -> tuple:
        self.held_earlier.append(sum(ref() is not None for ref in self.refs))
        self.refs.append(weakref.ref(buffer))
        return _copy_as_handle(buffer)


class IpcStubEngine:
    """What vLLM's ipc backend does with a packed bucket, per GPU: each GPU's worker takes the
    handle of its GPU and splits the buffer by `tensor_sizes`."""

    name = "http://e0"

    def __init__(
        self, w: dict, fail_on_update: int | None = None, worker_gpus: tuple[str, ...] = ("gpu-0", "gpu-1")
    ) -> None:
        self.spec = {
            "source": "stub",
            "served_dtype": "bfloat16",
            "tensors": {n: {"shape": list(t.shape), "dtype": "bfloat16"} for n, t in w.items()},
        }
        self.loaded: dict[str, dict[str, torch.Tensor]] = {}
        self.version, self.updates, self.fail_on_update = 0, 0, fail_on_update
        self.worker_gpus = list(worker_gpus)  # a TP=2 engine on both trainer ranks' GPUs

    async def collective_rpc(self, method, kwargs=None, args=None, timeout_s=None):
        if method == DEVICE_UUID_RPC:
            return self.worker_gpus
        return [self.spec] * len(self.worker_gpus)

    async def api(self):
        from types import SimpleNamespace

        return SimpleNamespace(ipc_packed_in_update=False)

    async def update_weights(self, info):
        self.updates += 1
        if self.updates == self.fail_on_update:
            raise RuntimeError("engine died")
        for uuid, (_, flat) in pickle.loads(base64.b64decode(info["ipc_handles_pickled"])).items():
            offset = 0
            for name, dtype, shape, size in zip(
                info["names"], info["dtype_names"], info["shapes"], info["tensor_sizes"]
            ):
                self.loaded.setdefault(uuid, {})[name] = (
                    flat[offset : offset + size].view(getattr(torch, dtype)).view(shape)
                )
                offset += size

    async def finish_weight_update(self, version):
        self.version = version

    async def weight_version(self):
        return self.version

    async def request(self, *a, **kw):
        return None

    async def init_weight_transfer(self, info):
        pass

    async def pause(self, mode):
        pass

    async def resume(self):
        pass

    async def reset_prefix_cache(self):
        pass

    async def start_weight_update(self):
        pass

    async def aclose(self):
        pass


def _publish(w, engine, channel, reduce_fn=_copy_as_handle):
    from vime_core.config import make_config
    from vime_core.weight_sync.publish import publish_weights
    from vime_core.weight_sync.transport.ipc import IpcTransport

    transport = IpcTransport(torch.device("cpu"), reduce_fn, "gpu-0", peers=channel)
    try:
        return publish_weights(
            w.items(),
            [engine.name],
            1,
            make_config({"update_weight_buffer_size": 2048}),
            transport=transport,
            client_factory=lambda url: engine,
            peers=channel,
        )
    finally:
        channel.release()


def _outcome(fn) -> tuple:
    try:
        return ("ok", fn())
    except Exception as err:
        return ("error", f"{type(err).__name__}: {err}")


def _rank_main(rank: int, port: int, results) -> None:
    from vime_core.weight_sync.transport.ipc_peers import PeerChannel, follow_publish

    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        channel = PeerChannel(torch.distributed.new_group(backend="gloo"), rank)
        w = _weights()
        bad = {**w, "model.norm.weight": torch.ones(33)}
        missing = {k: v for k, v in w.items() if k != "model.norm.weight"}
        out = {}
        if rank == 0:
            good, counter = IpcStubEngine(w), HandleCounter()
            out["ok"] = _outcome(lambda: _publish(w, good, channel, counter)["buckets"])
            out["held_earlier"] = counter.held_earlier
            out["loaded"] = {
                uuid: {n: torch.equal(t, w[n].to(torch.bfloat16)) for n, t in got.items()}
                for uuid, got in good.loaded.items()
            }
            out["invalid"] = _outcome(lambda: _publish(bad, IpcStubEngine(w), channel))
            out["engine_fails"] = _outcome(lambda: _publish(w, IpcStubEngine(w, fail_on_update=2), channel))
            out["peer_fails"] = _outcome(lambda: _publish(w, IpcStubEngine(w), channel))
            misplaced = IpcStubEngine(w, worker_gpus=("gpu-0", "gpu-7"))
            out["misplaced"] = _outcome(lambda: _publish(w, misplaced, channel))
            out["misplaced_updates"] = misplaced.updates
        else:
            follow = lambda tensors, reduce_fn=_copy_as_handle: follow_publish(
                tensors.items(), channel, torch.device("cpu"), "gpu-1", reduce_fn
            )
            counter = HandleCounter()
            out["ok"] = _outcome(lambda: follow(w, counter))
            out["held_earlier"] = counter.held_earlier
            out["invalid"] = _outcome(lambda: follow(w))
            out["engine_fails"] = _outcome(lambda: follow(w))
            out["peer_fails"] = _outcome(lambda: follow(missing))
            out["misplaced"] = _outcome(lambda: follow(w))
        torch.distributed.destroy_process_group()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"crashed": traceback.format_exc()}))


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=100) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():  # a rank stuck in a collective: do not leave it behind
                p.terminate()
    assert not any("crashed" in o for o in out.values()), out
    return out


def test_every_gpu_gets_a_handle_to_the_same_bytes(ranks):
    buckets = ranks[0]["ok"]
    assert buckets[0] == "ok" and buckets[1] > 1  # 2 KiB buckets: several exchanges
    assert ranks[1]["ok"] == ("ok", buckets[1])  # the follower packed every bucket rank 0 sent
    names = set(_weights())
    assert ranks[0]["loaded"] == {"gpu-0": dict.fromkeys(names, True), "gpu-1": dict.fromkeys(names, True)}


def test_each_rank_lets_a_bucket_go_once_the_engines_loaded_it(ranks):
    """A publish holds one bucket's buffer on each rank, not a model's worth: at every handle it
    hands out, no earlier bucket's buffer is alive."""
    buckets = ranks[0]["ok"][1]
    for rank in (0, 1):
        assert ranks[rank]["held_earlier"] == [0] * buckets, rank


def test_a_publish_refused_before_any_byte_releases_the_other_rank(ranks):
    assert ranks[0]["invalid"][0] == "error" and "model.norm.weight" in ranks[0]["invalid"][1]
    assert ranks[1]["invalid"] == ("ok", 0)


def test_an_engine_failing_mid_publish_releases_the_other_rank(ranks):
    assert ranks[0]["engine_fails"][0] == "error" and "engine died" in ranks[0]["engine_fails"][1]
    assert ranks[1]["engine_fails"] == ("ok", 2)  # it packed the two buckets rank 0 sent, then was let go


def test_a_rank_that_cannot_pack_fails_the_publish_naming_itself(ranks):
    assert ranks[0]["peer_fails"][0] == "error" and "rank 1: KeyError" in ranks[0]["peer_fails"][1]
    assert ranks[1]["peer_fails"][0] == "error" and "KeyError" in ranks[1]["peer_fails"][1]


def test_an_engine_worker_on_a_gpu_no_rank_publishes_from_is_refused_before_any_byte(ranks):
    outcome, message = ranks[0]["misplaced"]
    assert outcome == "error" and "http://e0 worker 1 (GPU gpu-7)" in message and "weight_transport=nccl" in message
    assert ranks[0]["misplaced_updates"] == 0  # refused before the first /update_weights
    assert ranks[1]["misplaced"] == ("ok", 1)  # the other rank packed the first bucket and was let go
