"""The transfer checksum (vime_core/wire/checksum.py) on a GPU gives the CPU's numbers for the same
bytes: the nccl transport sums on the trainer's GPU, an engine worker on its own, and neither knows
how the other reduced. Needs torch only: `python3 -m pytest --noconftest tests/gpu/test_wire_checksum_gpu.py`
runs it on a bare GPU host."""

from __future__ import annotations

import pytest
import torch

from vime_core.wire.checksum import mismatched, tensor_checksums

pytestmark = [pytest.mark.unit, pytest.mark.gpu(gpus=1)]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.bool, torch.float8_e4m3fn]


def _tensor(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype == torch.int64:  # sums that wrap around 2**64
        return torch.randint(-(2**62), 2**62, (numel,), generator=g, dtype=torch.int64)
    return (torch.randn(numel, generator=g) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpu_checksums_equal_the_cpus(dtype):
    views = [(f"t{i}", _tensor(dtype, n, i)) for i, n in enumerate((1, 4097, 3 << 20))]
    on_gpu = [(name, t.cuda()) for name, t in views]
    assert tensor_checksums(on_gpu) == tensor_checksums(views)


def test_a_large_bf16_tensor_sums_alike_and_one_bit_shows():
    t = _tensor(torch.bfloat16, 1 << 28, 7)  # 512 MiB: one bucket's worth
    sent = tensor_checksums([("w", t)])
    received = t.cuda()
    assert mismatched([("w", received)], sent) == []
    received.view(torch.int16)[123_456_789] ^= 1
    assert mismatched([("w", received)], sent) == ["w"]
