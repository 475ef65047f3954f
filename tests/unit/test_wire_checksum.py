"""wire/checksum.py against a reference computed from the raw bytes in Python, and the sender's
checksums in a shared-memory bucket against what a worker would read back."""

from __future__ import annotations

import struct

import pytest
import torch

from vime_core.wire.checksum import mismatched, tensor_checksums

FORMATS = {1: "b", 2: "h", 4: "i", 8: "q"}  # element width -> struct's signed integer of that width


def reference_checksum(t: torch.Tensor) -> int:
    """The module docstring's sum from the little-endian bytes: 64-bit words when the bytes start
    at and number a multiple of 8, else elements of their own width; wrapped to a signed int64."""
    raw = bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())
    width = 8 if len(raw) % 8 == 0 and t.data_ptr() % 8 == 0 else t.element_size()
    words = struct.unpack(f"<{len(raw) // width}{FORMATS[width]}", raw)
    total = sum(words) % 2**64
    return total - 2**64 if total >= 2**63 else total


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool, torch.float8_e4m3fn]
)
@pytest.mark.parametrize("numel", [1, 3, 4096], ids=lambda n: f"{n}el")  # odd sizes take the element sum
def test_checksum_is_the_integer_sum_of_the_bytes(dtype, numel):
    g = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        t = torch.rand(numel, generator=g) > 0.5
    elif dtype == torch.int64:  # large enough that the sum wraps around 2**64
        t = torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=torch.int64) * 3
    else:
        t = (torch.randn(numel, generator=g) * 100).to(dtype)
    assert tensor_checksums([("t", t)]) == [reference_checksum(t)]
    assert tensor_checksums([("t", t[1:])]) == [reference_checksum(t[1:])]  # misaligned start: elements


def test_checksum_does_not_depend_on_the_reduction_order_and_sees_one_bit():
    t = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    (whole,) = tensor_checksums([("t", t)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # one thread reduces in another order than several
        assert tensor_checksums([("t", t)]) == [whole]
    finally:
        torch.set_num_threads(threads)
    halves = tensor_checksums([("a", t[:1000]), ("b", t[1000:])])
    assert (sum(halves) - whole) % 2**64 == 0  # exact: parts add up to the whole
    flipped = t.clone()
    flipped.view(torch.int16)[1234] ^= 1  # the lowest mantissa bit of one weight, below any bf16 noise
    assert tensor_checksums([("t", flipped)]) != [whole]


def test_mismatched_names_only_the_tensors_that_differ():
    a, b, c = torch.ones(3), torch.zeros(5, dtype=torch.bfloat16), torch.arange(4, dtype=torch.int32)
    sent = tensor_checksums([("a", a), ("b", b), ("c", c)])
    b[2] = 1.0
    assert mismatched([("a", a), ("b", b), ("c", c)], sent) == ["b"]
    with pytest.raises(ValueError, match="2 checksums for 3 tensors"):
        mismatched([("a", a), ("b", b), ("c", c)], sent[:2])


def test_shm_bucket_carries_the_checksums_of_what_it_wrote(tmp_path):
    from vime_core.weight_sync.buckets import iter_buckets
    from vime_core.weight_sync.transport.shm import write_bucket_file
    from vime_core.weight_sync.transport.shm_pool import ShmBufferPool
    from vime_core.wire.layout import bucket_views
    from vime_core.wire.shm_format import ShmBucketInfo

    tensors = {"w": torch.randn(5, 3), "b": torch.randn(7), "s": torch.tensor(2.5)}
    (bucket,) = iter_buckets(tensors.items(), 1 << 30, {n: torch.bfloat16 for n in tensors})
    pool = ShmBufferPool(str(tmp_path))
    try:
        info = write_bucket_file(bucket, pool)
        # the sender sums the bf16 it wrote, not the fp32 it was given
        assert info.checksums == [reference_checksum(t.to(torch.bfloat16)) for t in tensors.values()]
        raw = torch.frombuffer(bytearray(open(info.path, "rb").read()), dtype=torch.uint8)
        received = bucket_views(raw, info.names, info.dtype_names, info.shapes, info.offsets)
        assert mismatched(received, info.checksums) == []
        raw[info.offsets[1]] ^= 0x01  # one bit of "b" changed in transit
        assert mismatched(received, info.checksums) == ["b"]
        assert ShmBucketInfo(**info.to_dict()) == info  # the checksums survive the JSON round trip
        assert write_bucket_file(bucket, pool, checksums=False).checksums is None
        with pytest.raises(ValueError, match="checksums has 2 entries, names has 3"):
            ShmBucketInfo(**{**info.to_dict(), "checksums": info.checksums[:2]})
    finally:
        pool.release()
