"""The wire format of the broadcast weight transports (backend `vime_broadcast`): one group spanning the
trainer's rank 0 and every worker of every engine, one broadcast per bucket from rank 0. Both sides
import it (the trainer's transport/broadcast.py, the worker's broadcast_backend.py), so it uses the
standard library only; descriptors travel as JSON.

    ranks    engine e's worker w is rank_offset(e) + w, rank_offset(e) = 1 + the worker counts of
             engines 0..e-1; world = 1 + all workers
    bucket   one flat uint8 buffer: tensor i occupies tensor_sizes[i] bytes from sum(tensor_sizes[:i]),
             C-contiguous, in its wire dtype; a worker outside `group_id` refuses it before any collective,
             and one whose received bytes miss the descriptor's `checksums` (wire/checksum.py) after it"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from vime_core.wire.layout import place, tensor_nbytes

BACKEND_NAME = "vime_broadcast"
CARRIERS = ("nccl", "gloo")
# the worker extension's `/collective_rpc` method that names the group a worker is in (one
# answer per worker: the trainer also learns how many workers an engine has)
GROUP_ID_RPC = "vime_broadcast_group_id"


@dataclass
class BroadcastInitInfo:
    """`init_info` of `/init_weight_transfer_engine`: join group `group_id` (replacing any group
    the worker was in) as rank `rank_offset + worker rank` of `world_size`."""

    carrier: str
    rendezvous: dict
    group_id: str
    rank_offset: int
    world_size: int

    def __post_init__(self) -> None:
        if self.carrier not in CARRIERS:
            raise ValueError(f"vime_broadcast: carrier {self.carrier!r} is not one of {CARRIERS}")
        if not 1 <= self.rank_offset < self.world_size:
            raise ValueError(
                f"vime_broadcast: rank_offset {self.rank_offset} must be in [1, world_size={self.world_size})"
            )
        needed = ("unique_id",) if self.carrier == "nccl" else ("host", "port")
        missing = [k for k in needed if k not in self.rendezvous]
        if missing:
            raise ValueError(f"vime_broadcast: {self.carrier} rendezvous lacks {missing}")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BroadcastBucketInfo:
    """`update_info` of one `/update_weights` call: what the next broadcast holds."""

    group_id: str
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)
    tensor_sizes: list[int] = field(default_factory=list)
    checksums: list[int] | None = None  # wire/checksum.py, one per tensor; None: not checked

    def __post_init__(self) -> None:
        n = len(self.names)
        for what in ("dtype_names", "shapes", "tensor_sizes") + (("checksums",) if self.checksums is not None else ()):
            if len(getattr(self, what)) != n:
                raise ValueError(f"vime_broadcast bucket: {what} has {len(getattr(self, what))} entries, names has {n}")
        for name, dtype, shape, size in zip(self.names, self.dtype_names, self.shapes, self.tensor_sizes):
            if tensor_nbytes(dtype, shape) != size:
                raise ValueError(
                    f"vime_broadcast bucket: tensor {name!r} ({dtype} {shape}) is "
                    f"{tensor_nbytes(dtype, shape)} bytes, descriptor says {size}"
                )

    @property
    def nbytes(self) -> int:
        return sum(self.tensor_sizes)

    def offsets(self) -> list[int]:
        """Where each tensor starts: back to back (`layout.place`, alignment 1)."""
        return place(self.tensor_sizes)[0]

    def to_dict(self) -> dict:
        return asdict(self)
