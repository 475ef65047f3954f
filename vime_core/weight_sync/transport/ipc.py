"""CUDA transport: CUDA IPC handles in the format of vLLM's own `ipc` weight-transfer engine. A
colocated engine maps the trainer's device memory and copies out of it, so the bytes never cross
PCIe or HTTP; every engine worker's GPU must have a handle (else: the nccl transport). The server
needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 to unpickle the handle.

A bucket's buffer is let go once every engine has loaded it (`/update_weights` returned), so a
publish holds one bucket, not a model's worth: vLLM's consumer clones what it unpacks before it
answers, and a block an engine still maps (vLLM >= 0.30 keeps the last mapping until the next
bucket) is kept out of reuse by torch's IPC reference count until `release_unmapped` finds it
released."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vime_core.weight_sync.buckets import Bucket, pack_ipc, release_unmapped
from vime_core.weight_sync.transport.base import WeightTransport
from vime_core.weight_sync.transport.ipc_peers import BUCKET, PeerChannel, merge_handles
from vime_core.wire.ipc_format import DEVICE_UUID_RPC, gpu_uuid, ipc_update_info


def unshared_workers(worker_gpus: list[tuple[str, list]], handle_gpus: set[str]) -> list[str]:
    """'engine worker w (GPU uuid)' for every engine worker whose GPU has no handle; workers that
    report no GPU (None) are not counted."""
    return [
        f"{engine} worker {w} (GPU {uuid})"
        for engine, uuids in worker_gpus
        for w, uuid in enumerate(uuids)
        if uuid is not None and uuid not in handle_gpus
    ]


def cuda_device_uuid(device: torch.device) -> str:
    return gpu_uuid(device.index or 0)


def default_reduce(buffer: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return args


class IpcTransport(WeightTransport):
    name = "ipc"

    def __init__(
        self,
        device: torch.device | None = None,
        reduce_fn: Callable[[torch.Tensor], tuple] = default_reduce,
        device_uuid: str | None = None,
        peers: "PeerChannel | None" = None,
    ) -> None:
        super().__init__()
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.reduce_fn = reduce_fn
        self.device_uuid = device_uuid
        self.peers = peers  # the other trainer ranks pack each bucket on their GPUs (ipc_peers.py)
        self._packed_in_update = False
        self._worker_gpus: list[tuple[str, list]] = []  # (engine, its workers' GPU UUIDs)
        self._placement_checked = False

    async def prepare(self, engines) -> None:
        await super().prepare(engines)
        if self.device_uuid is None:
            self.device_uuid = cuda_device_uuid(self.device)
        apis = {api.ipc_packed_in_update for api in await self.on_every_engine("api")}
        if len(apis) != 1:
            raise ValueError(
                "ipc transport: the engines run vLLM releases that expect the packed flag in different places"
            )
        self._packed_in_update = apis.pop()
        gpus = await self.on_every_engine("collective_rpc", DEVICE_UUID_RPC)
        self._worker_gpus = [(engine.name, list(uuids or [])) for engine, uuids in zip(self.engines, gpus)]
        await self.on_every_engine("init_weight_transfer", {} if self._packed_in_update else {"packed": True})

    async def send_bucket(self, bucket: Bucket) -> None:
        with self.timed("pack"):
            buffer, sizes = pack_ipc(bucket, self.device)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # the engine reads it from another process
            handles = {self.device_uuid: self.reduce_fn(buffer)}
            if self.peers is not None:  # nothing that can fail between the command and the gather
                self.peers.command((BUCKET, list(bucket.names), bucket.dtype_names))
                handles = merge_handles(self.peers.gather((self.device_uuid, handles[self.device_uuid], None)))
            if not self._placement_checked:  # before any byte moves: the publish can still be undone
                elsewhere = unshared_workers(self._worker_gpus, set(handles))
                if elsewhere:
                    raise ValueError(
                        f"ipc publish: {', '.join(elsewhere)} runs on a GPU no trainer rank publishes from "
                        f"({', '.join(sorted(handles))}); CUDA IPC needs every engine worker on a trainer "
                        "rank's GPU (colocate), for engines elsewhere use weight_transport=nccl"
                    )
                self._placement_checked = True
            info = ipc_update_info(bucket, sizes, handles, self._packed_in_update)
        self.bytes_moved = True
        with self.timed("wait_load"):
            await self.on_every_engine("update_weights", info)
        del buffer  # loaded by every engine: its memory may serve the next bucket (module docstring)
        release_unmapped()

    async def close(self) -> None:
        release_unmapped()
