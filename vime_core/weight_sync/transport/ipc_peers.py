"""CUDA IPC from every trainer rank's GPU: each worker of a TP engine opens the handle of its own GPU,
so colocated every trainer rank packs the same bucket of full HF tensors on its GPU and rank 0 sends
the engines one handle per GPU. Rank 0's commands go over a gloo group of all trainer ranks."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from vime_core.weight_sync.buckets import Bucket, pack_ipc, release_unmapped

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
    device and hand rank 0 its handle; let each buffer go at rank 0's next command, which comes once
    every engine has loaded the bucket (transport/ipc.py). Returns the buckets packed.

        rank 0 (IpcTransport.send_bucket)              rank r > 0 (follow_publish)
        command ("bucket", names, wire dtypes)    ->   pack those tensors on its GPU
        gather (uuid_0, handle_0), ...            <-   (uuid_r, handle_r) (or what failed)
        POST /update_weights {uuid: handle, ...}       keeps its buffer until the next command
        command ("bucket", ...) or ("done",)       ->  lets the buffer go

    Rank 0 sends "done" whatever failed (PeerChannel.release in its finally), so no rank waits forever."""
    tensors = dict(named_tensors)  # the TP gathers, in step with rank 0's "gather" phase
    buffer: torch.Tensor | None = None
    packed = 0
    failed: Exception | None = None
    try:
        while (message := channel.receive())[0] == BUCKET:
            buffer = None  # the engines have loaded the last bucket: rank 0 waited for them
            release_unmapped()
            _, names, dtype_names = message
            try:  # a failure here is answered, not raised: rank 0 waits in the gather
                bucket = Bucket(packed)
                for name, dtype_name in zip(names, dtype_names):
                    bucket.add(name, tensors[name], getattr(torch, dtype_name))
                buffer, _ = pack_ipc(bucket, device)
                if buffer.is_cuda:
                    torch.cuda.synchronize(buffer.device)  # engines read it from other processes
                packed += 1
                answer = (device_uuid, reduce_fn(buffer), None)
            except Exception as err:
                failed = failed or err
                answer = (device_uuid, None, f"rank {channel.rank}: {type(err).__name__}: {err}")
            channel.gather(answer)
    finally:
        buffer = None
        release_unmapped()
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
