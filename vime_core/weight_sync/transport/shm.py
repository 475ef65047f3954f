"""CPU transport: each bucket is written once into a tmpfs file that every engine maps (the `vime_shm`
backend). Packing bucket k+1 overlaps the engines loading bucket k, so a publish costs about
max(pack, load); bucket files come from a pool kept between publishes (`shm_pool`)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict

from vime_core.weight_sync.buckets import Bucket, copy_into, packed_checksums, packed_layout
from vime_core.weight_sync.transport.base import WeightTransport
from vime_core.weight_sync.transport.shm_pool import ShmBufferPool
from vime_core.wire.shm_format import ALIGNMENT, ShmBucketInfo, ShmInitInfo


def write_bucket_file(bucket: Bucket, pool: ShmBufferPool, checksums: bool = True) -> ShmBucketInfo:
    """Write the bucket's tensors (wire dtypes, `ALIGNMENT`-aligned) into pool slot
    `bucket.index` and return its descriptor; with `checksums`, the written tensors' checksums
    in it, which the engines check what they map against."""
    offsets, nbytes = packed_layout(bucket, ALIGNMENT)
    path, flat = pool.buffer(bucket.index, nbytes)
    for tensor, dtype, offset in zip(bucket.tensors, bucket.dtypes, offsets):
        copy_into(flat, offset, tensor, dtype)
    return ShmBucketInfo(
        path=path,
        nbytes=nbytes,
        names=list(bucket.names),
        dtype_names=bucket.dtype_names,
        shapes=[list(t.shape) for t in bucket.tensors],
        offsets=offsets,
        checksums=packed_checksums(flat, bucket, offsets) if checksums else None,
    )


class ShmTransport(WeightTransport):
    name = "shm"

    def __init__(self, shm_dir: str = "/dev/shm", pool: ShmBufferPool | None = None, checksums: bool = True) -> None:
        super().__init__()
        self.shm_dir = shm_dir
        self.checksums = checksums  # cfg.check_weight_transfer
        self.pool = pool
        self._owns_pool = False  # made here (no pool given): released at close
        self._locked = False
        self._in_flight: asyncio.Task | None = None
        self._staged: tuple[int, asyncio.Task] | None = None

    async def prepare(self, engines) -> None:
        await super().prepare(engines)
        if self.pool is None:
            self.pool, self._owns_pool = ShmBufferPool(self.shm_dir), True
        if not self.pool.lock.acquire(blocking=False):
            raise RuntimeError(f"another publish in this process is writing the shared-memory pool in {self.shm_dir}")
        self._locked = True
        await self.on_every_engine("init_weight_transfer", asdict(ShmInitInfo(shm_dir=self.pool.shm_dir)))

    def stage(self, bucket: Bucket) -> None:
        """Start packing `bucket` now, while the engines are still being paused. Only when every
        engine let go of the pool at the end of the last session (`pool.clean`); otherwise the
        bucket is packed in `send_bucket`, after `start` made the engines drop their mappings."""
        assert self.pool is not None, "prepare() first"
        if self.pool.clean and self._staged is None:
            self._staged = (bucket.index, asyncio.create_task(self._pack(bucket)))

    async def start(self) -> None:
        assert self.pool is not None, "prepare() first"
        self.pool.clean = False
        # Engines drop their mappings of the previous publish here, before any slot is rewritten.
        await super().start()

    async def send_bucket(self, bucket: Bucket) -> None:
        if self._staged is not None and self._staged[0] == bucket.index:
            info = await self._staged[1]
            self._staged = None
        else:
            info = await self._pack(bucket)
        await self._drain()
        self.bytes_moved = True
        self._in_flight = asyncio.create_task(self.on_every_engine("update_weights", info.to_dict()))

    async def _pack(self, bucket: Bucket) -> ShmBucketInfo:
        with self.timed("pack"):
            return await asyncio.to_thread(write_bucket_file, bucket, self.pool, self.checksums)

    async def finish(self, version: int) -> None:
        await self._drain()
        await super().finish(version)
        self.pool.clean = True

    async def abort(self) -> None:
        was_open = self.session_open
        await super().abort()
        if was_open and self.pool is not None:
            self.pool.clean = True  # the empty session closed: engines dropped their mappings

    async def close(self) -> None:
        if self._in_flight is not None:
            self._in_flight.cancel()
            await asyncio.gather(self._in_flight, return_exceptions=True)
        if self._staged is not None:
            # a packing thread cannot be cancelled (cancelling the task would return while the
            # thread still writes into the pool's slot): wait for it to end
            await asyncio.gather(self._staged[1], return_exceptions=True)
        self._in_flight = self._staged = None
        if self._locked and self.pool is not None:
            self.pool.lock.release()
            self._locked = False
        if self._owns_pool and self.pool is not None:
            self.pool.release()
            self.pool, self._owns_pool = None, False

    async def _drain(self) -> None:
        """Wait until the engines have loaded the bucket in flight."""
        if self._in_flight is None:
            return
        task, self._in_flight = self._in_flight, None
        with self.timed("wait_load"):
            await task
