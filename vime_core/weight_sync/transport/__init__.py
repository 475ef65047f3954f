"""Weight transports behind one interface (`base.WeightTransport`), picked by placement: shm (CPU engines
on the trainer's machine), ipc (engines on the trainer's GPUs), nccl (GPU engines elsewhere), gloo (CPU engines
elsewhere), disk (anywhere both sides see one path)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vime_core.config import weight_transport
from vime_core.weight_sync.transport.base import WeightTransport
from vime_core.weight_sync.transport.broadcast import BroadcastTransport, rendezvous_host
from vime_core.weight_sync.transport.disk import DiskTransport
from vime_core.weight_sync.transport.ipc import IpcTransport
from vime_core.weight_sync.transport.shm import ShmTransport

if TYPE_CHECKING:
    from vime_core.config.schema import VimeConfig
    from vime_core.weight_sync.publish_loop import PublishLoop
    from vime_core.weight_sync.transport.ipc_peers import PeerChannel

__all__ = ["WeightTransport", "make_transport"]


def make_transport(
    cfg: "VimeConfig",
    shm_dir: str = "/dev/shm",
    keeper: "PublishLoop | None" = None,
    peers: "PeerChannel | None" = None,
) -> WeightTransport:
    """A fresh transport for one publish, by `vime_core.config.weight_transport(cfg)`; `keeper`
    (the publisher's PublishLoop) lends what outlives one publish (the shm transport's pool);
    `peers`: the other trainer ranks also publish from their GPUs (ipc only: ipc_peers.py)."""
    kind = weight_transport(cfg)
    if kind == "shm":
        pool = keeper.shm_pool(shm_dir) if keeper is not None else None
        return ShmTransport(shm_dir, pool=pool, checksums=cfg.check_weight_transfer)
    if kind == "disk":
        return DiskTransport(shm_dir)
    if kind == "ipc":
        return IpcTransport(peers=peers)
    if kind in ("nccl", "gloo"):
        import torch

        device = torch.device("cuda", torch.cuda.current_device()) if kind == "nccl" else torch.device("cpu")
        host = rendezvous_host(cfg.engine_bind_host)
        return BroadcastTransport(kind, host, device, keeper=keeper, checksums=cfg.check_weight_transfer)
    raise ValueError(f"weight_transport={kind!r} is not one of shm, ipc, nccl, gloo, disk")
