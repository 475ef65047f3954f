"""The wire format of one weight bucket passed through shared memory (backend `vime_shm`).

Both sides import this module: the trainer (which writes the bucket) and the vLLM worker
(which reads it), so it uses the standard library only.

A bucket is one file on a tmpfs (`/dev/shm`) holding a flat byte buffer; tensor `i` occupies
bytes `[offsets[i], offsets[i] + numel(shapes[i]) * itemsize(dtype_names[i]))`, C-contiguous.
Offsets are multiples of `ALIGNMENT` so every tensor can be viewed in place with its dtype.
The descriptor (this dataclass as a dict) travels as the `update_info` of vLLM's
`POST /update_weights`; it is plain JSON, so no insecure serialization is needed.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

BACKEND_NAME = "vime_shm"
ALIGNMENT = 64  # bytes; a cache line, and a multiple of every dtype's size
FILE_PREFIX = "vime-wb-"  # every bucket file's name starts with this
DEFAULT_SHM_DIR = "/dev/shm"

# dtype name (torch's, without "torch.") -> bytes per element
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


def tensor_nbytes(dtype_name: str, shape: list[int] | tuple[int, ...]) -> int:
    """numel(shape) * itemsize(dtype)."""
    if dtype_name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype_name!r}; supported: {sorted(ITEMSIZE)}")
    return math.prod(shape) * ITEMSIZE[dtype_name]


@dataclass
class ShmInitInfo:
    """`init_info` of `/init_weight_transfer_engine`: the only directory bucket files may come
    from (the worker refuses paths elsewhere, so a descriptor cannot make it map any file)."""

    shm_dir: str = DEFAULT_SHM_DIR


@dataclass
class ShmBucketInfo:
    """`update_info` of one `/update_weights` call: where the bucket is and what it holds."""

    path: str
    nbytes: int
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.names)
        for what in ("dtype_names", "shapes", "offsets"):
            if len(getattr(self, what)) != n:
                raise ValueError(f"bucket {self.path}: {what} has {len(getattr(self, what))} entries, names has {n}")
        if not os.path.basename(self.path).startswith(FILE_PREFIX):
            raise ValueError(f"bucket path {self.path!r}: file name must start with {FILE_PREFIX!r}")
        for name, dtype, shape, off in zip(self.names, self.dtype_names, self.shapes, self.offsets):
            size = tensor_nbytes(dtype, shape)
            if off % ALIGNMENT or off < 0 or off + size > self.nbytes:
                raise ValueError(
                    f"bucket {self.path}: tensor {name!r} at offset {off} ({size} bytes) is misaligned "
                    f"or outside the {self.nbytes}-byte buffer"
                )

    def to_dict(self) -> dict:
        return asdict(self)
