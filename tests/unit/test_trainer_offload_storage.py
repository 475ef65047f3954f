"""Sleep/wake frees storages in place, so Megatron's gradient hooks survive a wake.

Megatron's DDP adds each gradient into ``main_grad`` from a hook on the parameter's autograd
gradient accumulator. Changing a parameter's device through ``.data`` makes autograd drop that
accumulator (and the hook); on a GPU the grad norm after the first wake was then 0. CPU tensors
cannot change device here (``.data`` refuses a "meta" tensor), so these tests check the
replacement: storages freed and restored in place, values intact, the hook still firing.
"""

from __future__ import annotations

import pytest
import torch

from vime_core.trainer.offload import release_to_host, restore_from_host


def _hooked_parameter(device: str = "cpu") -> tuple[torch.nn.Parameter, list[int], object]:
    """A parameter with a hook on its gradient accumulator, registered the way Megatron's DDP does."""
    param = torch.nn.Parameter(torch.randn(4, 3, device=device))
    fired: list[int] = []
    accumulator = param.expand_as(param).grad_fn.next_functions[0][0]
    accumulator.register_hook(lambda *_: fired.append(1))
    return param, fired, accumulator  # the caller keeps the accumulator alive, as DDP does


def test_release_and_restore_keep_values_and_free_the_storage():
    a, b = torch.randn(5, 2), torch.randn(7)
    view = a[1:3]  # shares a's storage: copied once
    before = (a.clone(), b.clone())
    copies = release_to_host([a, view, b])
    assert len(copies) == 2
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 0
    restore_from_host(copies)
    torch.testing.assert_close(a, before[0])
    torch.testing.assert_close(b, before[1])
    torch.testing.assert_close(view, before[0][1:3])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        # only a device change through .data drops the accumulator, so only CUDA can catch a regression
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="needs a CUDA device: the CPU case cannot change device"
            ),
        ),
    ],
)
def test_gradient_hook_still_fires_after_release_and_restore(device):
    param, fired, _accumulator = _hooked_parameter(device)
    restore_from_host(release_to_host([param]))
    (param * 2).sum().backward()
    assert fired == [1]
    torch.testing.assert_close(param.grad, torch.full((4, 3), 2.0, device=device))


def test_prepin_makes_the_buffers_a_release_asks_for():
    from vime_core.trainer.offload import prepin_host_memory

    a, b = torch.randn(5, 2), torch.randn(7, dtype=torch.float64)
    tensors = [a, a[1:3], b, torch.empty(0)]  # a view shares a's storage; an empty one needs nothing
    assert prepin_host_memory(tensors) == sum(c.host.numel() for c in release_to_host(tensors)) == 5 * 2 * 4 + 7 * 8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: only a GPU pins host memory")
def test_after_a_prepin_a_release_pins_no_new_host_memory():
    from vime_core.trainer.offload import prepin_host_memory

    tensors = [torch.randn(3 << 20, device="cuda"), torch.randn(5 << 18, device="cuda", dtype=torch.bfloat16)]
    prepin_host_memory(tensors)
    made = torch.cuda.host_memory_stats()["num_host_alloc"]
    copies = release_to_host(tensors)
    assert all(c.host.is_pinned() for c in copies)
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == made  # every buffer came from the cache


def _adam_after(steps: int, device: str = "cpu") -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    params = [torch.nn.Parameter(torch.randn(6, 4, device=device)), torch.nn.Parameter(torch.randn(9, device=device))]
    frozen = torch.nn.Parameter(torch.randn(3, device=device), requires_grad=False)
    opt = torch.optim.AdamW([*params, frozen], lr=1e-3)
    for _ in range(steps):
        sum((p * p).sum() for p in params).backward()
        opt.step()
    return params, opt


def test_prepin_counts_the_adam_moments_the_first_step_creates():
    """Before the first step Adam has no moments: the prepin makes room for two per trainable
    parameter, each its size; after the step they are ordinary state, counted by the release."""
    from vime_core.trainer.offload import adam_moments_to_come, prepin_host_memory

    params, opt = _adam_after(0)
    moments = 2 * sum(p.numel() * p.element_size() for p in params)
    assert sum(n for n, _ in adam_moments_to_come(opt)) == moments
    assert prepin_host_memory(params, opt) == sum(p.numel() * 4 for p in params) + moments
    params, opt = _adam_after(1)
    assert adam_moments_to_come(opt) == []
    states = [v for s in opt.state.values() for k, v in s.items() if k.startswith("exp_avg")]
    assert sum(t.numel() * t.element_size() for t in states) == moments


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: only a GPU pins host memory")
def test_after_a_prepin_the_first_sleep_after_a_step_pins_no_new_host_memory():
    from vime_core.trainer.offload import _tensors, prepin_host_memory

    params, opt = _adam_after(0, "cuda")
    model = torch.nn.Module()
    model.ps = torch.nn.ParameterList(params)
    prepin_host_memory([t for t in _tensors(model, opt) if t.device.type == "cuda"], opt)
    made = torch.cuda.host_memory_stats()["num_host_alloc"]
    sum((p * p).sum() for p in params).backward()
    opt.step()
    copies = release_to_host(t for t in _tensors(model, opt) if t.device.type == "cuda")
    assert copies and torch.cuda.host_memory_stats()["num_host_alloc"] == made
