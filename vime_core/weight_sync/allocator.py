"""The trainer's CUDA caching allocator: expandable segments, except for memory shared over CUDA IPC.

Asleep (offload_train), a trainer rank should hold on the device only what it still needs. With
PyTorch's default allocator a segment (one cudaMalloc) goes back to the driver only once every
block in it is free, so a few small tensors left in segments that held activations keep those
whole segments reserved: on an H200, 0.07 GiB still allocated after the publish kept 3.3 GiB
reserved (39% of the awake 8.5 GiB; docs/measurements.md). With expandable segments a segment
is virtual memory mapped page by page, and `torch.cuda.empty_cache()` unmaps every free page.

The publish's buckets are shared with the engines over CUDA IPC, which needs cudaMalloc'd memory:
expandable memory is shared as a file descriptor that the engine must fetch with pidfd_getfd,
which needs ptrace rights over the trainer's process. Buckets are therefore allocated with
expandable segments switched off for the allocation (`plain_segments`); PyTorch's allocator then
serves only non-expandable blocks, and those segments are released whole after the publish.

A configuration the user chose (PYTORCH_CUDA_ALLOC_CONF in the trainer's environment) is left as
it is. vLLM's engines are other processes with their own allocator (their sleep mode refuses
expandable segments) and are not touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterator

import torch

log = logging.getLogger(__name__)

_expandable = False  # this process switched expandable segments on (use_expandable_segments)


def _set(setting: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


def use_expandable_segments(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Switch this process's CUDA allocator to expandable segments, before the model is built;
    False (nothing changed) on CPU or when PYTORCH_CUDA_ALLOC_CONF is set."""
    global _expandable
    if not torch.cuda.is_available():
        return False
    if environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        log.info(
            "PYTORCH_CUDA_ALLOC_CONF=%s is set: the trainer's allocator is left as configured",
            environ["PYTORCH_CUDA_ALLOC_CONF"],
        )
        return False
    _set("expandable_segments:True")
    _expandable = True
    return True


@contextlib.contextmanager
def plain_segments() -> Iterator[None]:
    """Allocations inside come from cudaMalloc'd segments, which CUDA IPC can share."""
    if not _expandable:
        yield
        return
    _set("expandable_segments:False")
    try:
        yield
    finally:
        _set("expandable_segments:True")
