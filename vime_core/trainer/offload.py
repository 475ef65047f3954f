"""Sleep/wake of the trainer's device memory between phases (offload_train): `offload` copies the
parameters, optimizer state and fp32 main parameters to pinned host memory, frees their storage and
DDP's gradient buffers, and returns the allocator's cache; `onload` reverses it. On CPU both are
logged no-ops."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch

from vime_core.utils.device_memory import processes_bytes

log = logging.getLogger(__name__)


def torch_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers inside: Megatron returns a ChainedOptimizer of Megatron optimizers,
    each wrapping a torch one."""
    return [getattr(w, "optimizer", w) for w in getattr(optimizer, "chained_optimizers", [optimizer])]


def _tensors(model: Any, optimizer: Any, keep_params: bool = False) -> Iterator[torch.Tensor]:
    """Parameters, the optimizer's params (fp32 main copies under bf16) and its state tensors;
    with `keep_params`, nothing that shares storage with a model parameter."""
    seen: set[int] = set()
    if keep_params:
        seen = {id(p) for p in model.parameters()}
        kept = {p.untyped_storage().data_ptr() for p in model.parameters()}
    optimizers = torch_optimizers(optimizer)
    groups = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    states = [v for o in optimizers for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in [*model.parameters(), *groups, *states]:
        if id(t) in seen or (keep_params and t.untyped_storage().data_ptr() in kept):
            continue
        seen.add(id(t))
        yield t


@dataclass
class HostCopy:
    """The bytes of one device storage, kept on the host while the storage is freed."""

    tensor: torch.Tensor  # any tensor on the storage: it keeps the storage object alive
    host: torch.Tensor  # uint8, pinned when the storage is on a GPU


def _bytes_of(storage: Any, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _distinct_storages(tensors: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, Any]]:
    """(a tensor, its storage) for each distinct storage of ``tensors`` that holds bytes."""
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        yield t, storage


def _host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def release_to_host(tensors: Iterable[torch.Tensor]) -> list[HostCopy]:
    """Copy each distinct storage of ``tensors`` to the host and resize it to 0 bytes."""
    copies: list[HostCopy] = []
    for t, storage in _distinct_storages(tensors):
        host = _host_buffer(storage.nbytes(), t.device)
        host.copy_(_bytes_of(storage, t.device))
        storage.resize_(0)
        copies.append(HostCopy(t, host))
    return copies


def prepin_host_memory(tensors: Iterable[torch.Tensor], optimizer: Any = None) -> int:
    """Make, then free, the host buffers ``release_to_host(tensors)`` will ask for, and those of the
    Adam moments `optimizer`'s first step will create (`adam_moments_to_come`); returns their
    bytes. On a GPU they are pinned, and torch's caching host allocator keeps a freed pinned
    block for the next request of its size: a later release then only copies, without pinning
    new pages (cudaHostAlloc) on top. Run while nothing waits on it (the trainer's start, beside
    the engines'), it takes the pinning off the first sleep."""
    sizes = [(storage.nbytes(), t.device) for t, storage in _distinct_storages(tensors)]
    sizes += adam_moments_to_come(optimizer) if optimizer is not None else []
    buffers = [_host_buffer(n, device) for n, device in sizes]
    return sum(b.numel() for b in buffers)  # freed on return: to the allocator's cache, not the OS


def adam_moments_to_come(optimizer: Any) -> list[tuple[int, torch.device]]:
    """(bytes, device) of the two moments (exp_avg, exp_avg_sq: each like its parameter) that
    Adam's first step creates for every trainable parameter without state yet; they are half of a
    full fine-tuning's sleep and do not exist before that step."""
    fresh = [p for o in torch_optimizers(optimizer) for g in o.param_groups for p in g["params"] if not o.state.get(p)]
    return [(p.numel() * p.element_size(), p.device) for p in fresh if p.requires_grad for _ in range(2)]


def restore_from_host(copies: Iterable[HostCopy]) -> None:
    """Give each storage its bytes back (asynchronous on a GPU: synchronise before use)."""
    for c in copies:
        storage = c.tensor.untyped_storage()
        storage.resize_(c.host.numel())
        _bytes_of(storage, c.tensor.device).copy_(c.host, non_blocking=True)


def offload(model: Any, optimizer: Any, keep_params: bool = False) -> tuple[int, list[HostCopy]]:
    """Free the training state's device memory; returns (device bytes freed, the host copies
    ``onload`` needs). Tensors that live on the CPU (torch Adam keeps its ``step`` counters
    there) are left alone. `keep_params`: the model's parameters stay (below).

    Tensors keep their device while asleep, only their storage resized to 0 bytes and back (as
    Megatron does): moving them with `t.data = t.data.to("cpu")` changes a parameter's device, autograd
    then drops the hook through which Megatron's DDP fills main_grad, and training silently stops.
    With keep_params the parameters follow later (`offload_params`): in a colocated step the engines
    copy the new weights out of them over CUDA IPC after the trainer sleeps."""
    if not torch.cuda.is_available():
        log.info("sleep: CPU trainer, nothing to free (no-op)")
        return 0, []
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    copies = release_to_host(t for t in _tensors(model, optimizer, keep_params) if t.device.type == "cuda")
    model.offload_grad_buffers(synchronize=True, empty_cache=False)
    torch.cuda.empty_cache()
    freed = before - torch.cuda.memory_allocated()
    log.info("sleep: freed %.1f MiB of device memory%s", freed / 2**20, " (parameters kept)" if keep_params else "")
    return freed, copies


def sleep_tensors(model: Any, optimizer: Any, frozen: Iterable[Any] = ()) -> list[torch.Tensor]:
    """The device tensors a sleep copies to the host: ``offload``'s, then ``offload_params``'
    (the model's parameters, and each frozen model's). A critic sleeps on its own (trainer/critic.py)."""
    tensors = [t for t in _tensors(model, optimizer) if t.device.type == "cuda"]
    return tensors + [p for m in frozen for p in m.parameters() if p.device.type == "cuda"]


def offload_params(model: Any) -> tuple[int, list[HostCopy]]:
    """The parameters an ``offload(keep_params=True)`` left behind; (bytes freed, copies)."""
    if not torch.cuda.is_available():
        return 0, []
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    copies = release_to_host(p for p in model.parameters() if p.device.type == "cuda")
    # Blocks that were shared with the engines by CUDA IPC (the publish's buckets) stay reserved
    # until collected, even once the engines closed them: empty_cache alone leaves them.
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    return before - torch.cuda.memory_allocated(), copies


def device_memory() -> dict[str, int]:
    """This process's allocator (bytes allocated and reserved, and the most allocated since
    `reset_peak`) and what the device attributes to the process (`process_bytes`, nvidia-smi:
    allocator, CUDA context, NCCL and library workspaces); empty on CPU."""
    if not torch.cuda.is_available():
        return {}
    return {
        "allocated_bytes": torch.cuda.memory_allocated(),
        "reserved_bytes": torch.cuda.memory_reserved(),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "process_bytes": processes_bytes({os.getpid()}),
    }


def reset_peak() -> None:
    """Start a new `peak_allocated_bytes` window (a phase's own peak: train, publish)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def onload_params(copies: list[HostCopy]) -> int:
    """Bring back the parameters ``offload_params`` freed, and nothing else; returns the bytes allocated."""
    if not torch.cuda.is_available():
        return 0
    before = torch.cuda.memory_allocated()
    restore_from_host(copies)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() - before


def onload(model: Any, copies: list[HostCopy]) -> int:
    """Bring back what ``offload`` freed; returns the bytes allocated."""
    if not torch.cuda.is_available():
        log.info("wake: CPU trainer, nothing to restore (no-op)")
        return 0
    before = torch.cuda.memory_allocated()
    restore_from_host(copies)
    model.restore_grad_buffers(synchronize=True)
    return torch.cuda.memory_allocated() - before
