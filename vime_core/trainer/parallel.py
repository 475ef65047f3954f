"""torch.distributed + Megatron parallel state for one trainer rank (TP x DP, experts over EP).

Ranks are laid out TP-innermost (Megatron's order "tp-cp-ep-dp-pp"): with TP=2 and 8 ranks,
ranks {0,1} are one TP group and {0,2,4,6} one DP group, so ``tp_rank = rank % tp`` and
``dp_rank = rank // tp``. Experts split over EP ranks inside the DP group, each still split over
TP (expert TP = TP, Megatron's "tp-ep-dp-pp" for experts): with EP=2 above, {0,2} and {4,6} are
EP groups ({0,4} and {2,6} expert-DP groups), so ``ep_rank = dp_rank % ep``. The backend is gloo
on CPU and NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
from megatron.core import parallel_state

from vime_core.trainer import compat_cpu
from vime_core.wire.broadcast_group import LOOPBACK, joining_store, listening_store
from vime_core.utils.processes import free_port  # noqa: F401  (re-exported: single-machine process groups)


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits in the TP x DP grid, and in the EP split of the DP ranks."""

    rank: int
    world_size: int
    tp_size: int
    tp_rank: int
    dp_size: int
    dp_rank: int
    ep_size: int = 1
    ep_rank: int = 0

    @property
    def holds_first_copy(self) -> bool:
        """Whether this rank holds part of the first whole copy of the weights: DP replica 0's TP
        group and, with EP > 1, the DP ranks holding the other experts (expert-DP rank 0). These
        ranks gather the HF weights for a publish or an export together."""
        return self.dp_rank // self.ep_size == 0


def layout_for(rank: int, world_size: int, tp_size: int, ep_size: int = 1) -> ParallelLayout:
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tensor_model_parallel_size={tp_size} does not divide world_size={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside world_size={world_size}")
    dp_size, dp_rank = world_size // tp_size, rank // tp_size
    if ep_size < 1 or dp_size % ep_size:
        raise ValueError(
            f"expert_model_parallel_size={ep_size} does not divide the data-parallel size {dp_size} "
            f"(world_size={world_size} / tensor_model_parallel_size={tp_size})"
        )
    return ParallelLayout(rank, world_size, tp_size, rank % tp_size, dp_size, dp_rank, ep_size, dp_rank % ep_size)


def init_parallel(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    tp_size: int,
    device: str = "cpu",
    timeout_s: float = 600.0,
    ep_size: int = 1,
) -> ParallelLayout:
    """Join the process group and create Megatron's TP/DP groups and its expert groups (EP, expert
    TP = TP, expert DP = DP / EP) (idempotent in a process)."""
    layout = layout_for(rank, world_size, tp_size, ep_size)
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank if torch.cuda.device_count() > 1 else 0)
    else:
        compat_cpu.activate()
    if not torch.distributed.is_initialized():
        # rank 0's store listens on master_addr only (torch's own would take every interface)
        if rank == 0:
            store, _ = listening_store(master_addr, master_port, world_size, timeout_s)
        else:
            store = joining_store(master_addr, master_port, world_size, timeout_s)
        if device != "cuda" and master_addr in LOOPBACK:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs too, not this host name's address
        torch.distributed.init_process_group(
            backend="nccl" if device == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=tp_size,
            # Extra gloo groups only serve the distributed optimizer, which we do not use.
            create_gloo_process_groups=False,
        )
    return layout


def destroy_parallel() -> None:
    """Leave the process group and forget Megatron's groups (for tests and shutdown)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
