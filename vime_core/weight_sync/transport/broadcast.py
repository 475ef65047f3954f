"""Broadcast transports for engines that do not share the trainer's memory: `nccl` (GPU engines on
other devices or nodes) and `gloo` (CPU engines on other machines). The trainer's rank 0 broadcasts
each bucket once to a group with every worker of every engine (format: vime_core/wire/). Blocking
calls run in daemon threads, so an engine that never joins cannot keep the trainer from exiting."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from vime_core.engines.server import advertised_host
from vime_core.weight_sync.buckets import Bucket, pack_flat, packed_checksums
from vime_core.weight_sync.transport.base import WeightTransport
from vime_core.wire.broadcast_format import GROUP_ID_RPC, BroadcastBucketInfo, BroadcastInitInfo
from vime_core.wire.broadcast_group import (
    LOOPBACK,
    BroadcastGroup,
    open_group,
    pooled_host_buffer,
    serve_rendezvous,
)

T = TypeVar("T")


@dataclass
class KeptGroup:
    """A formed group: its id, the engines it spans (in rank order), rank 0's end of it and, on
    CPU, the packed buckets of the last publish (`pooled_host_buffer`)."""

    group_id: str
    engine_urls: tuple[str, ...]
    group: BroadcastGroup
    host_buffers: list[torch.Tensor] = field(default_factory=list)

    def pack(self, bucket: Bucket, device: torch.device) -> tuple[torch.Tensor, list[int]]:
        if device.type != "cpu":
            return pack_flat(bucket, device)
        return pack_flat(bucket, device, lambda nbytes: pooled_host_buffer(self.host_buffers, bucket.index, nbytes))


class GroupKeeper(Protocol):
    """Who keeps a formed group between publishes: the publisher's `PublishLoop`.

    The group outlives a publish (forming one costs a rendezvous and NCCL setup). Before each publish
    `prepare` asks every worker which group it is in (GROUP_ID_RPC) and forms a new group when any
    answer differs or the engines changed; an engine that refuses a bucket aborts the broadcast and
    drops the group."""

    def broadcast_group(self, carrier: str) -> KeptGroup | None: ...

    def keep_broadcast_group(self, carrier: str, kept: KeptGroup | None) -> None: ...


def in_daemon_thread(fn: Callable[..., T], *args: Any) -> "asyncio.Future[T]":
    """Run a blocking call in a daemon thread; the returned future resolves on this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(setter: Callable[[Any], None], value: Any) -> None:
        if not future.done():
            setter(value)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, future.set_exception, exc)
        else:
            loop.call_soon_threadsafe(settle, future.set_result, result)

    threading.Thread(target=work, name=f"vime-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def rendezvous_host(engine_bind_host: str) -> str:
    """The address engines reach this (the trainer's) process at: loopback when the engines bind
    loopback (one machine), else this node's address (Ray's view of it inside a cluster)."""
    return "127.0.0.1" if engine_bind_host in LOOPBACK else advertised_host("0.0.0.0")


def rank_offsets(workers_per_engine: list[int]) -> tuple[list[int], int]:
    """Each engine's first rank (rank 0 is the trainer) and the group's size:
    offset(e) = 1 + sum(workers[:e]), world = 1 + sum(workers)."""
    offsets, at = [], 1
    for count in workers_per_engine:
        if count < 1:
            raise ValueError(f"an engine reported {count} workers")
        offsets.append(at)
        at += count
    return offsets, at


class BroadcastTransport(WeightTransport):
    def __init__(
        self,
        carrier: str,
        host: str,
        device: torch.device,
        keeper: GroupKeeper | None = None,
        timeout_s: float = 300.0,
        checksums: bool = True,
    ) -> None:
        super().__init__()
        self.checksums = checksums  # cfg.check_weight_transfer
        self.name = carrier  # "nccl" or "gloo"
        self.host = host  # the address engines reach this process at (the gloo store's)
        self.device = device
        self.keeper = keeper
        self.timeout_s = timeout_s
        self.kept: KeptGroup | None = None

    # -- group -----------------------------------------------------------------------------

    async def prepare(self, engines) -> None:
        await super().prepare(engines)
        answers = await self.on_every_engine("collective_rpc", GROUP_ID_RPC)
        urls = tuple(e.base_url for e in self.engines)
        kept = self.keeper.broadcast_group(self.name) if self.keeper is not None else None
        if kept is not None and kept.engine_urls == urls and all(a == kept.group_id for per in answers for a in per):
            self.kept = kept
            return
        if kept is not None:
            self._drop(kept)
        with self.timed("form_group"):
            self.kept = await self._form([len(per or []) for per in answers], urls)

    async def _form(self, workers: list[int], urls: tuple[str, ...]) -> KeptGroup:
        offsets, world = rank_offsets(workers)
        group_id = uuid.uuid4().hex
        rendezvous, local = serve_rendezvous(self.name, self.host, world, self.timeout_s)
        joining = in_daemon_thread(open_group, self.name, rendezvous, 0, world, self.device, self.timeout_s, local)
        inits = [
            asyncio.ensure_future(
                engine.init_weight_transfer(BroadcastInitInfo(self.name, rendezvous, group_id, offset, world).to_dict())
            )
            for engine, offset in zip(self.engines, offsets)
        ]
        try:
            await asyncio.gather(*inits)
        except BaseException:
            for task in inits:
                task.cancel()
            joining.add_done_callback(lambda f: f.exception() is None and f.result().close())
            raise
        group = await joining  # open_group gives up after timeout_s itself
        kept = KeptGroup(group_id, urls, group)
        if self.keeper is not None:
            self.keeper.keep_broadcast_group(self.name, kept)
        return kept

    def _drop(self, kept: KeptGroup, abort: bool = False) -> None:
        """Forget `kept` and free it. `abort`: a broadcast may still be blocked in it; aborting
        can wait for that broadcast's own timeout, so it runs in a daemon thread."""
        if self.keeper is not None and self.keeper.broadcast_group(self.name) is kept:
            self.keeper.keep_broadcast_group(self.name, None)
        if abort:
            threading.Thread(target=kept.group.abort, name="vime-broadcast-abort", daemon=True).start()
        else:
            kept.group.close()

    # -- session ---------------------------------------------------------------------------

    async def send_bucket(self, bucket: Bucket) -> None:
        assert self.kept is not None, "prepare() forms or finds the group first"
        with self.timed("pack"):
            buffer, sizes = self.kept.pack(bucket, self.device)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # packed on this thread's stream; sent from another
            info = BroadcastBucketInfo(
                self.kept.group_id,
                list(bucket.names),
                bucket.dtype_names,
                [list(t.shape) for t in bucket.tensors],
                sizes,
            )
            if self.checksums:  # over the tensors where the worker will view them
                info.checksums = packed_checksums(buffer, bucket, info.offsets())
        self.bytes_moved = True
        with self.timed("broadcast_and_load"):
            receiving = asyncio.ensure_future(self.on_every_engine("update_weights", info.to_dict()))
            sending = in_daemon_thread(self.kept.group.broadcast, buffer)
            done, _ = await asyncio.wait({receiving, sending}, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((f for f in (receiving, sending) if f in done and f.exception() is not None), None)
            if failed is not None:
                kept, self.kept = self.kept, None
                self._drop(kept, abort=True)  # unblocks rank 0's broadcast; the group is unusable now
                other = sending if failed is receiving else receiving
                if other.done():
                    other.exception()  # retrieved: only the first failure is raised
                else:
                    other.cancel()
                raise failed.exception()
            await asyncio.gather(receiving, sending)

    async def close(self) -> None:
        if self.keeper is None and self.kept is not None:  # nobody keeps it for the next publish
            self._drop(self.kept)
            self.kept = None
