"""The trainer's CUDA caching allocator: expandable segments, except for memory shared over CUDA IPC.
Asleep, a rank should hold only what it needs, but the default allocator returns a segment only once
all its blocks are free, so a few small tensors keep whole segments reserved (bench/results/colocated.jsonl, fcd3aa6);
expandable segments unmap every free page. IPC needs cudaMalloc'd memory, so buckets are allocated
in `plain_segments`. A PYTORCH_CUDA_ALLOC_CONF the user set is left as it is."""

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
