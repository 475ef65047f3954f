"""CPU transport: each bucket is written once into a tmpfs file and every engine maps it.

The vLLM side is the `vime_shm` backend (`vime_core/engines/vllm_side/shm_backend.py`), so the
standard session endpoints carry it: `/start_weight_update`, one `/update_weights` per bucket
with a `ShmBucketInfo` descriptor, `/finish_weight_update {"weight_version"}`.

Packing bucket k+1 (a thread: torch's copy releases the GIL) overlaps with the engines loading
bucket k, so the publish costs about max(pack, load) instead of their sum. A bucket file is
unlinked as soon as every engine has loaded it; engines keep their mapping (and so the pages)
only while vLLM still holds views for layers that are not complete yet.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import time
import uuid

import torch

from vime_core.engines.vllm_side.shm_format import ALIGNMENT, FILE_PREFIX, ShmBucketInfo, ShmInitInfo
from vime_core.trainer.buckets import Bucket, copy_into, packed_layout
from vime_core.trainer.transport.base import WeightTransport


def write_bucket_file(bucket: Bucket, shm_dir: str, tag: str) -> ShmBucketInfo:
    """Create `<shm_dir>/vime-wb-<tag>-<index>` holding the bucket's tensors (wire dtypes,
    `ALIGNMENT`-aligned) and return its descriptor."""
    offsets, nbytes = packed_layout(bucket, ALIGNMENT)
    path = os.path.join(shm_dir, f"{FILE_PREFIX}{tag}-{bucket.index:05d}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        # MAP_POPULATE allocates the tmpfs pages in one call instead of one fault per page.
        mapped = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    try:
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        for tensor, dtype, offset in zip(bucket.tensors, bucket.dtypes, offsets):
            copy_into(flat, offset, tensor, dtype)
        del flat
    finally:
        mapped.close()
    return ShmBucketInfo(
        path=path,
        nbytes=nbytes,
        names=list(bucket.names),
        dtype_names=[str(d).removeprefix("torch.") for d in bucket.dtypes],
        shapes=[list(t.shape) for t in bucket.tensors],
        offsets=offsets,
    )


class ShmTransport(WeightTransport):
    name = "shm"

    def __init__(self, shm_dir: str = "/dev/shm") -> None:
        super().__init__()
        self.shm_dir = shm_dir
        self.tag = uuid.uuid4().hex[:12]
        self._in_flight: asyncio.Task | None = None
        self._in_flight_path: str | None = None
        self._files: set[str] = set()

    async def prepare(self, engines) -> None:
        await super().prepare(engines)
        if not os.path.isdir(self.shm_dir):
            raise FileNotFoundError(f"shm transport: {self.shm_dir!r} (shared-memory folder) does not exist")
        await self.on_every_engine("init_weight_transfer", ShmInitInfo(shm_dir=self.shm_dir).__dict__)

    async def start(self) -> None:
        await self.on_every_engine("start_weight_update")
        self.session_open = True

    async def send_bucket(self, bucket: Bucket) -> None:
        t0 = time.perf_counter()
        info = await asyncio.to_thread(write_bucket_file, bucket, self.shm_dir, self.tag)
        self._files.add(info.path)
        self.add_time("pack", time.perf_counter() - t0)
        await self._drain()
        self.bytes_moved = True
        self._in_flight = asyncio.create_task(self.on_every_engine("update_weights", info.to_dict()))
        self._in_flight_path = info.path

    async def finish(self, version: int) -> None:
        await self._drain()
        t0 = time.perf_counter()
        await self.on_every_engine("finish_weight_update", version)
        self.session_open = False
        self.add_time("finish", time.perf_counter() - t0)

    async def close(self) -> None:
        if self._in_flight is not None and not self._in_flight.done():
            self._in_flight.cancel()
        for path in self._files:
            _unlink_quietly(path)
        self._files.clear()

    async def _drain(self) -> None:
        """Wait until the engines have loaded the bucket in flight, then drop its file."""
        if self._in_flight is None:
            return
        t0 = time.perf_counter()
        task, path = self._in_flight, self._in_flight_path
        self._in_flight = self._in_flight_path = None
        try:
            await task
        finally:
            if path is not None:
                _unlink_quietly(path)
                self._files.discard(path)
            self.add_time("wait_load", time.perf_counter() - t0)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
