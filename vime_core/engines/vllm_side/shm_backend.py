"""vLLM weight-transfer engine `vime_shm`: receives weight buckets through shared memory on CPU.

vLLM's own `ipc` and `nccl` backends need CUDA. This one plugs into the same session
(`start_weight_update` -> `update_weights` per bucket -> `finish_weight_update`) and reads
each bucket from a tmpfs file described by a `ShmBucketInfo` (see `shm_format`).

Loading follows vLLM's checkpoint-format reload: `start` puts every layer in layerwise-reload
mode, each bucket's tensors go through the model's own `load_weights` (which fuses q/k/v and
gate/up and shards for TP), and `finish` runs the deferred per-layer processing. A layer is
processed only once all its weights arrived, possibly several buckets later, and until then
vLLM keeps *views* of the bucket, so the mapped buckets stay open until `finish` (the trainer
may already have unlinked the files; the mapping keeps the pages alive).

Runs inside the vLLM worker: imports only vllm, torch and the standard library.
"""

from __future__ import annotations

import math
import mmap
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from vime_core.engines.vllm_side.shm_format import DEFAULT_SHM_DIR, ShmBucketInfo, ShmInitInfo

MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # value from linux/mman.h


@dataclass
class UpdateStats:
    """Where a worker's time went during the last (or current) weight-update session."""

    buckets: int = 0
    bytes: int = 0
    map_seconds: float = 0.0
    load_seconds: float = 0.0
    finish_seconds: float = 0.0
    loaded_names: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": self.buckets, "bytes": self.bytes, "map_seconds": self.map_seconds,
            "load_seconds": self.load_seconds, "finish_seconds": self.finish_seconds,
            "loaded_tensors": len(self.loaded_names),
        }


def refresh_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run weight post-processing of layers whose weight is tied to another layer's.

    Why: on CPU, linear-like layers keep a pre-packed copy of their weight for the GEMM kernels
    (`dispatch_cpu_unquantized_gemm`, built in `process_weights_after_loading`). A tied
    `lm_head` receives no tensor of its own during a reload, so vLLM's layerwise reload puts its
    (shared, updated) weight back without re-packing, and logits keep using the old embedding.
    Seen with vLLM CPU 0.32.0 for both the weight-update session and `reload_weights`.
    Returns the names of the layers refreshed.
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append((name, module))
    refreshed = []
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for name, module in modules:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                quant_method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed


class ShmWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """Loads `ShmBucketInfo` buckets into the worker's model."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmBucketInfo
    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.shm_dir = os.path.realpath(DEFAULT_SHM_DIR)
        self._mapped: list[tuple[mmap.mmap, torch.Tensor]] = []
        self.stats = UpdateStats()

    # -- session ---------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        shm_dir = os.path.realpath(init_info.shm_dir)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"vime_shm: shm_dir {init_info.shm_dir!r} is not a directory")
        self.shm_dir = shm_dir

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._release()
        self.stats = UpdateStats()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes the accelerator after each chunk, which raises on a
        # CPU-only torch; loading here is synchronous, so only sync when there is one.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShmBucketInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        t0 = time.perf_counter()
        weights = self._map_bucket(update_info)
        t1 = time.perf_counter()
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        t2 = time.perf_counter()
        self.stats.buckets += 1
        self.stats.bytes += update_info.nbytes
        self.stats.map_seconds += t1 - t0
        self.stats.load_seconds += t2 - t1
        self.stats.loaded_names.update(update_info.names)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                finalize_layerwise_reload(self.model, self.model_config)
                refresh_tied_layers(self.model)
        finally:
            self._release()
        self.stats.finish_seconds = time.perf_counter() - t0

    def shutdown(self) -> None:
        self._release()

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:  # abstract on vLLM 0.26
        raise NotImplementedError("vime_shm is driven by vime's trainer (vime_core/trainer/transport/shm.py)")

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
            # (~2x faster on the project's VM). Linux >= 5.14; older kernels just fault.
            mapped.madvise(MADV_POPULATE_READ)
        except (OSError, ValueError):
            pass
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=info.nbytes)
        self._mapped.append((mapped, flat))
        weights = []
        for name, dtype_name, shape, offset in zip(info.names, info.dtype_names, info.shapes, info.offsets):
            dtype = getattr(torch, dtype_name)
            nbytes = dtype.itemsize * math.prod(shape)
            weights.append((name, flat[offset : offset + nbytes].view(dtype).view(shape)))
        return weights

    def _release(self) -> None:
        """Drop the mapped buckets. The views vLLM buffered are gone once processing ran."""
        maps = [mm for mm, _ in self._mapped]
        self._mapped = []  # drops our tensors over the mappings before closing them
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a view is still alive somewhere; the GC unmaps it later
                pass
