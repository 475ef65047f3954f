"""The wire format of one weight bucket in shared memory (backend `vime_shm`), imported by the trainer's
transport and the vLLM worker, so standard library only. A bucket is one tmpfs file; tensor i at
`offsets[i]` (multiples of ALIGNMENT, so viewable in place), C-contiguous. The descriptor travels as
plain JSON in `update_info`: no insecure serialization. `checksums` (wire/checksum.py), when
given, are what the worker checks the mapped bytes against before loading them."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from vime_core.wire.layout import tensor_nbytes

BACKEND_NAME = "vime_shm"
ALIGNMENT = 64  # bytes; a cache line, and a multiple of every dtype's size
FILE_PREFIX = "vime-wb-"  # every bucket file's name starts with this
DEFAULT_SHM_DIR = "/dev/shm"


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
    checksums: list[int] | None = None  # wire/checksum.py, one per tensor; None: not checked

    def __post_init__(self) -> None:
        n = len(self.names)
        for what in ("dtype_names", "shapes", "offsets") + (("checksums",) if self.checksums is not None else ()):
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
