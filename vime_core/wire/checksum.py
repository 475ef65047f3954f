"""An exact check that a bucket's bytes arrived as they were sent: each tensor's checksum, computed by
the sender on the packed bucket and by the worker on what it received, before anything is loaded.

    checksum(t) = sum_i w_i  (mod 2**64, as a signed 64-bit integer)

w_i the i-th little-endian 64-bit word of `t`'s bytes when they start at an address and number a
multiple of 8 (a bucket's weight matrices: summed in place at memory speed), else the i-th element
read as a signed integer of its own width (a bf16 weight's 16 bits as an int16). Both ends view the
same bucket layout from buffers whose bases are 64-byte aligned, so they take the same words.
Integer addition is exact and associative, so the sum does not depend on the order a GPU or a
thread pool reduces in, unlike any float statistic (the weight check's log-probs cannot see an
error below bf16 noise). It misses errors that cancel: words swapped within a tensor, or changes
whose sum is a multiple of 2**64. Standard library only at import (torch inside the functions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_SIGNED = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}  # element width in bytes -> integer view


def tensor_checksums(views: Sequence[tuple[str, "torch.Tensor"]]) -> list[int]:
    """checksum(t) of each (name, tensor) view, C-contiguous (a bucket's `bucket_views`), in order."""
    import torch  # boundary: the wire formats load without torch (wire/__init__.py)

    if not views:
        return []
    sums = [_word_sum(t.reshape(-1)) for _, t in views]
    return [int(s) for s in torch.stack(sums).tolist()]  # one transfer from a GPU, not one per tensor


def _word_sum(flat: "torch.Tensor") -> "torch.Tensor":
    """The module docstring's sum of one C-contiguous tensor, flattened, as a 0-d int64 tensor."""
    import torch  # boundary: as in tensor_checksums

    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    if nbytes % 8 == 0 and flat.data_ptr() % 8 == 0:
        return flat.view(torch.int64).sum()  # int64 accumulates in place; wraps mod 2**64
    # a narrower integer summed with dtype=int64 is first copied wide: slower, for the few odd tensors
    return flat.view(getattr(torch, _SIGNED[flat.element_size()])).sum(dtype=torch.int64)


def mismatched(views: Sequence[tuple[str, "torch.Tensor"]], expected: Sequence[int]) -> list[str]:
    """The names of the views whose checksum is not the sender's (`expected`, in the same order)."""
    if len(expected) != len(views):
        raise ValueError(f"{len(expected)} checksums for {len(views)} tensors")
    return [name for (name, _), got, want in zip(views, tensor_checksums(views), expected) if got != want]
