"""A weight bucket's bytes, as both ends see them: one flat uint8 buffer, tensor i C-contiguous in its
wire dtype from

    offsets[0] = 0,   offsets[i] = align_up(offsets[i-1] + nbytes[i-1], alignment)

alignment 1 for packed buffers (vime_broadcast, vLLM's ipc), shm_format.ALIGNMENT for shm files.
Standard library only at import (torch inside `bucket_views`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# dtype name (torch's, without "torch.") -> bytes per element
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


def tensor_nbytes(dtype_name: str, shape: list[int] | tuple[int, ...]) -> int:
    """numel(shape) * itemsize(dtype)."""
    if dtype_name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype_name!r}; supported: {sorted(ITEMSIZE)}")
    return math.prod(shape) * ITEMSIZE[dtype_name]


def place(sizes: list[int], alignment: int = 1) -> tuple[list[int], int]:
    """Each tensor's byte offset (the module docstring's rule) and the buffer's total size."""
    offsets: list[int] = []
    end = 0
    for size in sizes:
        start = align_up(end, alignment)
        offsets.append(start)
        end = start + size
    return offsets, end


def bucket_views(
    flat: "torch.Tensor", names: list[str], dtype_names: list[str], shapes: list[list[int]], offsets: list[int]
) -> list[tuple[str, "torch.Tensor"]]:
    """(name, tensor) views of a received bucket: tensor i is `dtype_names[i]` of `shapes[i]`,
    C-contiguous from byte `offsets[i]` of the uint8 buffer `flat` (zero copies)."""
    import torch  # boundary: the wire formats load without torch (wire/__init__.py): the driver reads them

    views = []
    for name, dtype_name, shape, offset in zip(names, dtype_names, shapes, offsets):
        dtype = getattr(torch, dtype_name)
        views.append((name, flat[offset : offset + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)))
    return views
