"""The trainer's allocator settings (vime_core/weight_sync/allocator.py): expandable segments on a
GPU unless the user configured the allocator, switched off only around IPC-shared allocations.
The allocator itself is stubbed here (CPU); the colocated GPU run measures its effect."""

from __future__ import annotations

import pytest
import torch

from vime_core.weight_sync import allocator


@pytest.fixture
def settings(monkeypatch):
    seen: list[str] = []
    monkeypatch.setattr(allocator, "_set", seen.append)
    monkeypatch.setattr(allocator, "_expandable", False)
    return seen


def test_cpu_changes_nothing(settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert allocator.use_expandable_segments({}) is False
    with allocator.plain_segments():
        pass
    assert settings == []


def test_gpu_uses_expandable_segments_and_plain_ones_for_ipc(settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert allocator.use_expandable_segments({}) is True
    with allocator.plain_segments():
        assert settings == ["expandable_segments:True", "expandable_segments:False"]
    assert settings[-1] == "expandable_segments:True"


def test_plain_segments_switch_back_when_the_allocation_fails(settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    allocator.use_expandable_segments({})
    with pytest.raises(MemoryError), allocator.plain_segments():
        raise MemoryError("out of memory")
    assert settings[-1] == "expandable_segments:True"


def test_a_user_allocator_configuration_is_kept(settings, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert allocator.use_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is False
    with allocator.plain_segments():
        pass
    assert settings == []


def test_the_setter_exists_in_this_torch():
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    assert callable(setter)
