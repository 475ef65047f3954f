"""Group HF-named tensors into weight-update buckets (one `/update_weights` call each) of a bounded size
in wire bytes. Rule, in arrival order: a tensor joins the open bucket if the total stays <=
`bucket_bytes`, else a new bucket starts with it; a larger tensor travels alone, no bucket is empty.
Packing follows wire/layout.py: `pack_flat`, `pack_ipc` (CUDA IPC memory), `copy_into` (shm files);
`packed_checksums` is what the worker checks the received bytes against (wire/checksum.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from vime_core.weight_sync.allocator import plain_segments
from vime_core.wire.checksum import tensor_checksums
from vime_core.wire.layout import bucket_views, place


@dataclass(frozen=True)
class DeferredTensor:
    """A tensor made when a bucket takes it (`iter_buckets`), so that a publish holds one bucket of
    such tensors at a time, not all of them: LoRA's merged weights W + s B A are new memory the size
    of the model (29.5 GB at 14B, beside the base's 29.5 GB). `shape` and `dtype` are the made
    tensor's, for the checks against the engine's spec before anything is made."""

    shape: torch.Size
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def numel(self) -> int:
        return self.shape.numel()


@dataclass
class Bucket:
    """Tensors sent together; `dtypes[i]` is tensor i's wire dtype, `nbytes` their wire bytes."""

    index: int
    names: list[str] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    nbytes: int = 0

    def add(self, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        self.names.append(name)
        self.tensors.append(tensor)
        self.dtypes.append(dtype)
        self.nbytes += wire_nbytes(tensor, dtype)

    def __len__(self) -> int:
        return len(self.names)

    @property
    def dtype_names(self) -> list[str]:
        """The wire dtypes as vLLM names them ("bfloat16")."""
        return [str(d).removeprefix("torch.") for d in self.dtypes]


def wire_nbytes(tensor: torch.Tensor, dtype: torch.dtype) -> int:
    return tensor.numel() * dtype.itemsize


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    wire_dtypes: Mapping[str, torch.dtype] | None = None,
) -> Iterator[Bucket]:
    """Yield buckets in arrival order (see the module docstring for the rule). A `DeferredTensor`
    is made as it joins its bucket: after the bucket before it was yielded (and sent)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive (cfg.update_weight_buffer_size)")
    bucket = Bucket(index=0)
    for name, tensor in named_tensors:
        dtype = wire_dtypes[name] if wire_dtypes is not None else tensor.dtype
        size = wire_nbytes(tensor, dtype)
        if len(bucket) and bucket.nbytes + size > bucket_bytes:
            yield bucket
            bucket = Bucket(index=bucket.index + 1)
        bucket.add(name, tensor.make() if isinstance(tensor, DeferredTensor) else tensor, dtype)
    if len(bucket):
        yield bucket


def packed_layout(bucket: Bucket, alignment: int = 1) -> tuple[list[int], int]:
    """Byte offsets of the bucket's tensors in one flat buffer, each rounded up to a multiple
    of `alignment`, and the buffer's total size: offset_i = align(offset_{i-1} + bytes_{i-1})
    (`wire/layout.place`)."""
    return place([wire_nbytes(t, d) for t, d in zip(bucket.tensors, bucket.dtypes)], alignment)


def copy_into(flat: torch.Tensor, offset: int, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """Write `tensor`, cast to `dtype`, C-contiguous into the uint8 buffer `flat` at `offset`
    (one pass over the bytes: the cast and the gather of a non-contiguous tensor happen in the
    same copy)."""
    n = wire_nbytes(tensor, dtype)
    dest = flat[offset : offset + n].view(dtype).view(tensor.shape)
    dest.copy_(tensor.detach())


def pack_flat(
    bucket: Bucket, device: torch.device, allocate: "Callable[[int], torch.Tensor] | None" = None
) -> tuple[torch.Tensor, list[int]]:
    """One flat uint8 buffer on `device` with the bucket's tensors back to back (no padding), and
    each tensor's size in bytes: the layout vLLM's packed IPC format and `vime_broadcast` split
    by sizes. Raises when a tensor would start at an offset that is not a multiple of its element
    size (the receiver views each slice as its dtype in place). `allocate(nbytes)`: where the
    buffer comes from (default: a fresh tensor on `device`)."""
    offsets, nbytes = packed_layout(bucket, alignment=1)
    for name, dtype, offset in zip(bucket.names, bucket.dtypes, offsets):
        if offset % dtype.itemsize:
            raise ValueError(
                f"bucket {bucket.index}: tensor {name!r} ({dtype}) would start at byte {offset}, "
                f"not a multiple of {dtype.itemsize}; send one wire dtype per bucket"
            )
    buffer = allocate(nbytes) if allocate is not None else torch.empty(nbytes, dtype=torch.uint8, device=device)
    for tensor, dtype, offset in zip(bucket.tensors, bucket.dtypes, offsets):
        copy_into(buffer, offset, tensor, dtype)
    return buffer, [wire_nbytes(t, d) for t, d in zip(bucket.tensors, bucket.dtypes)]


def packed_checksums(flat: torch.Tensor, bucket: Bucket, offsets: list[int]) -> list[int]:
    """Each of the bucket's tensors' checksum (wire/checksum.py) as packed in the uint8 buffer
    `flat` at `offsets`: read back from the bytes that travel, after the cast to the wire dtype."""
    shapes = [list(t.shape) for t in bucket.tensors]
    return tensor_checksums(bucket_views(flat, list(bucket.names), bucket.dtype_names, shapes, offsets))


def pack_ipc(bucket: Bucket, device: torch.device) -> tuple[torch.Tensor, list[int]]:
    """`pack_flat` into memory CUDA IPC can share: cudaMalloc'd segments only (`allocator.py`).
    Every trainer rank that publishes over IPC packs with it (`transport/ipc.py` on rank 0,
    `transport/ipc_peers.py` on the others)."""

    def shareable(nbytes: int) -> torch.Tensor:
        with plain_segments():
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    return pack_flat(bucket, device, shareable)


def release_unmapped() -> None:
    """Free the shared blocks no engine maps any more (torch keeps a dropped block that another
    process still maps in its IPC limbo until this finds its reference count at zero)."""
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
