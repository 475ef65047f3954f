"""vLLM weight-transfer engine `vime_shm`: receives weight buckets through shared memory on CPU, where
vLLM's own backends need CUDA. Each bucket is a tmpfs file described by a ShmBucketInfo
(wire/shm_format.py), loaded through the shared reload session; the mappings stay open until `finish`.
Runs inside the vLLM worker: vllm, torch, the standard library, vime_core.wire and
vime_core.utils.timing only."""

from __future__ import annotations

import mmap
import os

import torch

from vime_core.engines.vllm_side.reload_session import LayerwiseReloadEngine
from vime_core.utils.timing import timed
from vime_core.wire.layout import bucket_views
from vime_core.wire.shm_format import DEFAULT_SHM_DIR, ShmBucketInfo, ShmInitInfo

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # value from linux/mman.h


class ShmWeightTransferEngine(LayerwiseReloadEngine):
    """Loads `ShmBucketInfo` buckets into the worker's model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmBucketInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.shm_dir = os.path.realpath(DEFAULT_SHM_DIR)
        self._mapped: list[tuple[mmap.mmap, torch.Tensor]] = []

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        shm_dir = os.path.realpath(init_info.shm_dir)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"vime_shm: shm_dir {init_info.shm_dir!r} is not a directory")
        self.shm_dir = shm_dir

    def receive_weights(self, update_info: ShmBucketInfo) -> None:
        with timed() as receiving:
            weights = self._map_bucket(update_info)
        self.load(weights, update_info.nbytes, receiving.seconds, update_info.checksums)

    def shutdown(self) -> None:
        self.release_received()

    # -- buckets ---------------------------------------------------------------------------

    def _map_bucket(self, info: ShmBucketInfo) -> list[tuple[str, torch.Tensor]]:
        """Map the bucket file and return zero-copy views of its tensors."""
        path = os.path.realpath(info.path)
        if os.path.dirname(path) != self.shm_dir:
            raise ValueError(f"vime_shm: bucket {info.path!r} is outside {self.shm_dir!r}")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < info.nbytes:
                raise ValueError(f"vime_shm: bucket {info.path!r} has {size} bytes, descriptor says {info.nbytes}")
            # ACCESS_COPY: private and writable (torch wants a writable buffer, and a loader that
            # wrote into its input would only touch its own copy); shared with the page cache
            # until written.
            mapped = mmap.mmap(f.fileno(), info.nbytes, access=mmap.ACCESS_COPY)
        try:
            # Map every page now, in one call, instead of one fault per page during the copy
            # (fewer faults). Linux >= 5.14; older kernels just fault.
            mapped.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError):
            pass
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes)
        self._mapped.append((mapped, flat))
        return bucket_views(flat, info.names, info.dtype_names, info.shapes, info.offsets)

    def release_received(self) -> None:
        """Drop the mapped buckets. The views vLLM buffered are gone once processing ran."""
        maps = [mm for mm, _ in self._mapped]
        self._mapped = []  # drops our tensors over the mappings before closing them
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
