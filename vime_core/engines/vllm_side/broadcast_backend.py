"""vLLM weight-transfer engine `vime_broadcast`: receives buckets broadcast by the trainer's rank 0 over
NCCL or gloo (format and carriers: vime_core/wire/), through the shared reload session. Not vLLM's
own `nccl` backend: on 0.26 its rendezvous needs a pickled vLLM object, which a trainer without vLLM
cannot make. Runs inside the vLLM worker: vllm, torch, the standard library, vime_core.wire and
vime_core.utils.timing only."""

from __future__ import annotations

from typing import Any

import torch

from vime_core.engines.vllm_side.reload_session import LayerwiseReloadEngine
from vime_core.utils.timing import timed
from vime_core.wire.broadcast_format import BroadcastBucketInfo, BroadcastInitInfo
from vime_core.wire.broadcast_group import BroadcastGroup, open_group, pooled_host_buffer
from vime_core.wire.layout import bucket_views


def worker_group_rank(parallel_config: Any, rank_offset: int) -> int:
    """This worker's rank in the trainer<->engines group: its rank among all the engine's workers
    (data-parallel replicas first, then TP x PP) after the `rank_offset` ranks before it."""
    per_replica = parallel_config.world_size  # TP x PP
    replica = getattr(parallel_config, "data_parallel_index", getattr(parallel_config, "data_parallel_rank", 0)) or 0
    return rank_offset + replica * per_replica + parallel_config.rank


class BroadcastWeightTransferEngine(LayerwiseReloadEngine):
    init_info_cls = BroadcastInitInfo
    update_info_cls = BroadcastBucketInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: BroadcastGroup | None = None
        self.group_id: str | None = None
        self._received: list[torch.Tensor] = []
        self._host_buffers: list[torch.Tensor] = []  # CPU only: wire/broadcast_group.pooled_host_buffer

    def init_transfer_engine(self, init_info: BroadcastInitInfo) -> None:
        self._close_group()
        rank = worker_group_rank(self.parallel_config, init_info.rank_offset)
        if rank >= init_info.world_size:
            raise ValueError(f"vime_broadcast: worker rank {rank} is outside the group of {init_info.world_size}")
        self.group = open_group(init_info.carrier, init_info.rendezvous, rank, init_info.world_size, self.device)
        self.group_id = init_info.group_id

    def receive_weights(self, update_info: BroadcastBucketInfo) -> None:
        if self.group is None or update_info.group_id != self.group_id:
            # refused before the collective: the sender's group does not include this worker
            raise ValueError(
                f"vime_broadcast: bucket of group {update_info.group_id!r}, but this worker is in "
                f"{self.group_id!r}; initialise the weight transfer again"
            )
        with timed() as receiving:
            if self.device.type == "cpu":
                buffer = pooled_host_buffer(self._host_buffers, len(self._received), update_info.nbytes)
            else:  # on a GPU the memory goes back to the caching allocator, for the KV cache
                buffer = torch.empty(update_info.nbytes, dtype=torch.uint8, device=self.device)
            self.group.broadcast(buffer)
            self._received.append(buffer)
            weights = bucket_views(
                buffer, update_info.names, update_info.dtype_names, update_info.shapes, update_info.offsets()
            )
        self.load(weights, update_info.nbytes, receiving.seconds, update_info.checksums)

    def release_received(self) -> None:
        self._received = []

    def shutdown(self) -> None:
        self.release_received()
        self._host_buffers = []
        self._close_group()

    def _close_group(self) -> None:
        group, self.group, self.group_id = self.group, None, None
        if group is not None:
            group.close()
