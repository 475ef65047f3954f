"""Fallback transport: each bucket becomes a safetensors file in a fresh folder (on /dev/shm by
default), and `finish` asks every engine to reload from it (`vime_reload_weights`) and sets the
version; nothing reaches an engine before `finish`. vLLM's reload repoints model_config.model at
the folder, which is deleted afterwards, so every reload must pass a path."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from vime_core.weight_sync.buckets import Bucket
from vime_core.weight_sync.transport.base import WeightTransport


def write_bucket_safetensors(bucket: Bucket, folder: str) -> str:
    """Write the bucket (tensors cast to their wire dtypes) as one safetensors file."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to(d).contiguous() for n, t, d in zip(bucket.names, bucket.tensors, bucket.dtypes)}
    path = os.path.join(folder, f"model-{bucket.index:05d}.safetensors")
    save_file(tensors, path)
    return path


class DiskTransport(WeightTransport):
    name = "disk"

    def __init__(self, root: str = "/dev/shm") -> None:
        super().__init__()
        self.root = root
        self.folder: str | None = None

    async def start(self) -> None:
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"disk transport: folder {self.root!r} does not exist")
        self.folder = tempfile.mkdtemp(prefix="vime-weights-", dir=self.root)

    async def send_bucket(self, bucket: Bucket) -> None:
        assert self.folder is not None, "start() first"
        with self.timed("write"):
            await asyncio.to_thread(write_bucket_safetensors, bucket, self.folder)

    async def finish(self, version: int) -> None:
        assert self.folder is not None, "start() first"
        self.bytes_moved = True
        with self.timed("reload"):
            await self.on_every_engine("collective_rpc", "vime_reload_weights", {"weights_path": self.folder})
        with self.timed("finish"):
            await self.on_every_engine("update_weight_version", version)

    async def close(self) -> None:
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
