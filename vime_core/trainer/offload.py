"""Sleep/wake of the trainer's device memory between phases (offload_train).

On a GPU, ``offload`` moves every parameter, the optimizer's state and main (fp32) parameters
to pinned CPU memory and frees DDP's gradient buffers, then returns the allocator's cache to the
driver; ``onload`` reverses it. The bytes freed are measured as the drop of
``torch.cuda.memory_allocated()`` (what the engines can now use) and reported.

On CPU there is nothing to free: both are logged no-ops.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch

log = logging.getLogger(__name__)


def _tensors(model: Any, optimizer: Any) -> Iterator[torch.Tensor]:
    """Parameters, the optimizer's params (fp32 main copies under bf16) and its state tensors."""
    seen: set[int] = set()
    # Megatron returns a ChainedOptimizer of Megatron optimizers, each wrapping a torch one.
    wrappers = getattr(optimizer, "chained_optimizers", [optimizer])
    torch_optimizers = [getattr(w, "optimizer", w) for w in wrappers]
    groups = [p for o in torch_optimizers for g in o.param_groups for p in g["params"]]
    states = [v for o in torch_optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in [*model.parameters(), *groups, *states]:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


def offload(model: Any, optimizer: Any) -> tuple[int, list[torch.Tensor]]:
    """Move training state to CPU; returns (device bytes freed, the tensors moved). Tensors that
    already live on the CPU (torch Adam keeps its ``step`` counters there) are left alone, and
    only the moved ones go back in ``onload``."""
    if not torch.cuda.is_available():
        log.info("sleep: CPU trainer, nothing to free (no-op)")
        return 0, []
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    moved = [t for t in _tensors(model, optimizer) if t.device.type == "cuda"]
    for t in moved:
        t.data = t.data.to("cpu", non_blocking=False).pin_memory()
    model.offload_grad_buffers(synchronize=True, empty_cache=False)
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_allocated()
    log.info("sleep: freed %.1f MiB of device memory", freed / 2**20)
    return freed, moved


def onload(model: Any, moved: list[torch.Tensor]) -> int:
    """Bring the tensors ``offload`` moved back to the device; returns the bytes allocated."""
    if not torch.cuda.is_available():
        log.info("wake: CPU trainer, nothing to restore (no-op)")
        return 0
    before = torch.cuda.memory_allocated()
    device = torch.device("cuda", torch.cuda.current_device())
    for t in moved:
        t.data = t.data.to(device, non_blocking=True)
    model.restore_grad_buffers(synchronize=True)
    return torch.cuda.memory_allocated() - before
