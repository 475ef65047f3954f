"""CUDA IPC from every trainer rank's GPU.

A vLLM engine of tensor-parallel size t runs t workers on t GPUs, and each worker opens the CUDA
IPC handle of its own GPU (vLLM's `ipc` backend looks up `ipc_handles[its GPU's UUID]`) and
shards the full HF tensor itself. Colocated, those GPUs are the trainer ranks' GPUs, so every
rank packs the same bucket of full HF-named tensors (its TP group all-gathered them) on its own
GPU, and rank 0 sends the engines one handle per GPU:

    rank 0 (IpcTransport.send_bucket)              rank r > 0 (follow_publish)
    command ("bucket", names, wire dtypes)    ->   pack those tensors on its GPU
    gather (uuid_0, handle_0), ..., (uuid_r, .) <- (uuid_r, handle_r) (or what failed)
    POST /update_weights {uuid: handle, ...}       keeps its buffer: engines may read it until finish
    ...
    command ("done",)                          ->  frees its buffers

Rank 0 sends "done" when its publish returns or fails, whatever failed (`PeerChannel.release`
in the trainer's finally), so no rank waits for a publish that stopped. The messages go over a
gloo group of all trainer ranks (CPU objects, any thread), created at init by every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from vime_core.weight_sync.buckets import Bucket, pack_ipc

BUCKET, DONE = "bucket", "done"


class PeerChannel:
    """Rank 0's commands to the other trainer ranks and their answers, over `group`."""

    def __init__(self, group: Any, rank: int) -> None:
        self.group = group
        self.rank = rank

    def command(self, message: tuple) -> None:
        """Rank 0: one message to every other rank."""
        torch.distributed.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> tuple:
        """Rank r > 0: the next message of rank 0."""
        box: list[Any] = [None]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, item: Any) -> list[Any]:
        """Every rank's `item` on rank 0 (in rank order); [] elsewhere."""
        world = torch.distributed.get_world_size(self.group)
        out: list[Any] = [None] * world if self.rank == 0 else []
        torch.distributed.gather_object(item, out if self.rank == 0 else None, dst=0, group=self.group)
        return out

    def release(self) -> None:
        """Rank 0, after every publish (also a failed one, also one that sent nothing)."""
        self.command((DONE,))


def follow_publish(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    channel: PeerChannel,
    device: torch.device,
    device_uuid: str,
    reduce_fn: Callable[[torch.Tensor], tuple],
) -> int:
    """A rank r > 0's side of one IPC publish: pack each bucket rank 0 names on this rank's
    device and hand rank 0 its handle; free the buffers at "done". Returns the buckets packed."""
    tensors = dict(named_tensors)  # the TP gathers, in step with rank 0's "gather" phase
    buffers: list[torch.Tensor] = []
    failed: Exception | None = None
    try:
        while (message := channel.receive())[0] == BUCKET:
            _, names, dtype_names = message
            try:  # a failure here is answered, not raised: rank 0 waits in the gather
                bucket = Bucket(len(buffers))
                for name, dtype_name in zip(names, dtype_names):
                    bucket.add(name, tensors[name], getattr(torch, dtype_name))
                buffer, _ = pack_ipc(bucket, device)
                if buffer.is_cuda:
                    torch.cuda.synchronize(buffer.device)  # engines read it from other processes
                buffers.append(buffer)
                answer = (device_uuid, reduce_fn(buffer), None)
            except Exception as err:
                failed = failed or err
                answer = (device_uuid, None, f"rank {channel.rank}: {type(err).__name__}: {err}")
            channel.gather(answer)
    finally:
        packed = len(buffers)
        buffers.clear()
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()
    if failed is not None:
        raise failed
    return packed


def merge_handles(answers: list[tuple[str, Any, str | None]]) -> dict[str, Any]:
    """Rank 0: {GPU UUID: handle} from every rank's answer; a rank that failed to pack fails
    the bucket, naming it. Two ranks on one GPU give one handle (either holds the same bytes)."""
    errors = [error for _, _, error in answers if error]
    if errors:
        raise RuntimeError(f"ipc publish: {'; '.join(errors)}")
    return {uuid: handle for uuid, handle, _ in reversed(answers)}
