"""The CPU compatibility layer: inactive with CUDA, idempotent, and each shim does its one job."""

from __future__ import annotations

import sys

import pytest
import torch

from vime_core.trainer import compat_cpu

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inert on CUDA machines")


def test_activate_is_idempotent_and_redirects_current_device():
    assert compat_cpu.activate() is True
    patched = torch.cuda.current_device
    assert compat_cpu.activate() is True
    assert torch.cuda.current_device is patched  # not wrapped twice
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.zeros(2, device=torch.cuda.current_device()).device.type == "cpu"


def test_cuda_literals_land_on_cpu_in_the_shimmed_modules():
    import megatron.core.optimizer.clip_grads as clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    compat_cpu.activate()
    assert clip_grads.torch.zeros(1, dtype=torch.int, device="cuda").device.type == "cpu"
    assert clip_grads.torch.Tensor is torch.Tensor  # everything else is torch itself
    grads = [torch.full((3,), 2.0), torch.full((4,), 1.0)]
    norm, _ = local_multi_tensor_l2_norm(0, None, [grads], False)  # the grad-norm kernel
    assert norm.device.type == "cpu"
    assert float(norm) == pytest.approx(float(torch.cat(grads).norm()))


def test_paged_stash_stub_only_when_triton_is_absent(monkeypatch):
    fake = "email.mime.audio"  # a real, not-yet-imported module stands in for paged_stash
    monkeypatch.delitem(sys.modules, fake, raising=False)
    monkeypatch.setattr(compat_cpu, "PAGED_STASH_MODULE", fake)
    monkeypatch.setattr(compat_cpu, "_triton_available", lambda: True)
    compat_cpu._stub_paged_stash_without_triton()
    assert fake not in sys.modules
    monkeypatch.setattr(compat_cpu, "_triton_available", lambda: False)
    compat_cpu._stub_paged_stash_without_triton()
    assert "stub" in (sys.modules[fake].__doc__ or "")
    monkeypatch.delitem(sys.modules, fake)
