"""torch.distributed's TCP store with its master listening on one address.

torch's TCPStore master ignores the host it is given and listens on every interface (`::`), so a
trainer group or a broadcast group on loopback would take connections from the network. Here
rank 0 binds the socket itself, on the rendezvous host only, and hands it to the store."""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def listening_store(host: str, port: int, world_size: int, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """(rank 0's store listening on `host`:`port` only, the port): `port` 0 lets the OS choose.
    The others join it with `joining_store`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((host, port))
    listener.listen()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=False,
    )
    return store, port


def joining_store(host: str, port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A rank other than 0's connection to rank 0's store."""
    return dist.TCPStore(
        host, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), use_libuv=False
    )
