"""Bucketing of HF-named tensors for weight updates (vime_core.weight_sync.buckets)."""

from __future__ import annotations

import pytest
import torch

from vime_core.weight_sync.buckets import copy_into, iter_buckets, packed_layout, wire_nbytes


def named(sizes: list[int], dtype=torch.float32) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(f"t{i}", torch.randn(n, generator=g).to(dtype)) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("limit", [16, 64, 100, 400, 10_000])
def test_buckets_keep_order_stay_under_the_limit_and_oversized_tensors_go_alone(limit):
    tensors = named([3, 10, 1, 50, 7, 7, 2, 30])
    buckets = list(iter_buckets(tensors, limit))
    assert [n for b in buckets for n in b.names] == [n for n, _ in tensors]
    assert [b.index for b in buckets] == list(range(len(buckets)))
    for b in buckets:
        assert b.nbytes == sum(t.numel() * 4 for t in b.tensors)
        assert b.nbytes <= limit or len(b) == 1  # only a lone tensor may exceed the limit
    # greedy: a bucket was closed only because the next tensor did not fit
    for b, nxt in zip(buckets, buckets[1:]):
        assert b.nbytes + nxt.tensors[0].numel() * 4 > limit


def test_wire_dtype_decides_the_size():
    tensors = named([8, 8, 8, 8])
    as_fp32 = list(iter_buckets(tensors, 64))
    as_bf16 = list(iter_buckets(tensors, 64, {n: torch.bfloat16 for n, _ in tensors}))
    assert [len(b) for b in as_fp32] == [2, 2]
    assert [len(b) for b in as_bf16] == [4]
    assert as_bf16[0].dtypes == [torch.bfloat16] * 4 and as_bf16[0].nbytes == 64


def test_empty_input_gives_no_bucket_and_bad_limit_is_refused():
    assert list(iter_buckets([], 10)) == []
    with pytest.raises(ValueError, match="update_weight_buffer_size"):
        list(iter_buckets(named([1]), 0))


def test_layout_aligns_offsets_and_copy_into_casts_and_gathers():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = [("a", torch.ones(3)), ("b", base.t()), ("c", torch.tensor(5.0))]  # b is non-contiguous
    (bucket,) = iter_buckets(tensors, 1 << 20, {"a": torch.float32, "b": torch.bfloat16, "c": torch.float32})
    offsets, total = packed_layout(bucket, alignment=64)
    assert offsets == [0, 64, 128] and total == 128 + 4
    flat = torch.zeros(total, dtype=torch.uint8)
    for t, d, off in zip(bucket.tensors, bucket.dtypes, offsets):
        copy_into(flat, off, t, d)
    got_b = flat[64 : 64 + wire_nbytes(base, torch.bfloat16)].view(torch.bfloat16).view(4, 3)
    assert torch.equal(got_b, base.t().to(torch.bfloat16))
    assert float(flat[128:132].view(torch.float32)[0]) == 5.0
    assert packed_layout(bucket, alignment=1) == ([0, 12, 36], 40)


def test_deferred_tensors_are_made_as_their_bucket_fills_and_freed_with_it():
    """A publish holds one bucket of made tensors at a time: each is made when it joins its
    bucket, after the bucket before was yielded, and a bucket the consumer dropped holds nothing
    by the time the next one's tensors are made."""
    import gc
    import weakref

    from vime_core.weight_sync.buckets import DeferredTensor

    sizes = [8, 8, 8, 8, 8, 8, 40, 8]
    made: list[str] = []
    alive: dict[str, weakref.ref] = {}
    held_at_make: list[set[str]] = []

    def maker(name: str, n: int):
        def make() -> torch.Tensor:
            gc.collect()
            held_at_make.append({k for k, r in alive.items() if r() is not None})
            made.append(name)
            t = torch.full((n,), float(n))
            alive[name] = weakref.ref(t)
            return t

        return make

    tensors = [
        (f"t{i}", DeferredTensor(torch.Size([n]), torch.float32, maker(f"t{i}", n))) for i, n in enumerate(sizes)
    ]
    buckets: list[list[str]] = []
    for bucket in iter_buckets(tensors, 64):  # two fp32 tensors of 8 per bucket, the 40 alone
        buckets.append(bucket.names)
        assert made == [n for b in buckets for n in b]  # nothing of a later bucket made yet
        assert all(torch.equal(t, torch.full(t.shape, float(t.numel()))) for t in bucket.tensors)
        assert bucket.nbytes == sum(t.numel() * 4 for t in bucket.tensors)
        del bucket
    assert buckets == [["t0", "t1"], ["t2", "t3"], ["t4", "t5"], ["t6"], ["t7"]]
    # when a tensor was made, only its own bucket's earlier tensors were alive
    for name, held in zip(made, held_at_make):
        own = next(b for b in buckets if name in b)
        assert held <= set(own[: own.index(name)]), (name, held)


def test_a_deferred_tensor_has_the_shape_and_dtype_the_spec_check_reads():
    from vime_core.weight_sync.buckets import DeferredTensor
    from vime_core.weight_sync.weight_spec import check_against_spec

    d = DeferredTensor(torch.Size([2, 3]), torch.bfloat16, lambda: pytest.fail("made by the spec check"))
    spec = {"tensors": {"w": {"shape": [2, 3], "dtype": "bfloat16"}}}
    assert check_against_spec([("w", d)], spec, "e0") == {"w": torch.bfloat16}
    assert wire_nbytes(d, torch.float32) == 2 * 3 * torch.float32.itemsize
