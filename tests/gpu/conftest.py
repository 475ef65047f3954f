"""GPU checks: pass/fail runs on real GPUs, which CI's CPU machines cannot do.

Every test here is marked `gpu` (`@pytest.mark.gpu(gpus=N)`, N = 1 by default) and skips with
the reason where torch sees fewer than N CUDA devices, so on CPU the folder collects and reports
its skips. On a GPU host (the bundle of ../shared/gpu-host unpacked, see docs/measurements.md):

    python3 -m pytest tests/gpu -q -rs
"""

from __future__ import annotations

import functools

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu(gpus=1): needs that many CUDA devices; skipped with the reason where there are fewer")


@functools.cache
def cuda_devices() -> tuple[int, str]:
    """(CUDA devices torch sees, why there are none)."""
    try:
        import torch
    except ImportError as exc:
        return 0, f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return 0, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return torch.cuda.device_count(), ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("gpus", 1)
        have, why = cuda_devices()
        if have < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {have}" + (f": {why}" if why else "")))
