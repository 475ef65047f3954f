"""The trainer's process group on loopback listens on loopback only: torch's TCP store master, given
tcp://127.0.0.1:PORT, would listen on every interface (`::`), and take connections from the
network for the actor's whole life (vime_core/wire/broadcast_group.listening_store)."""

from __future__ import annotations

import socket
from pathlib import Path

from vime_core.trainer.parallel import destroy_parallel, init_parallel
from vime_core.utils.processes import free_port
from vime_core.wire.broadcast_group import listening_store

LISTEN = "0A"  # the TCP state in /proc/net/tcp*


def _listening_addresses(port: int) -> list[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found.append(address)
    return found


IPV4_LOOPBACK = socket.inet_aton("127.0.0.1")[::-1].hex().upper()  # little-endian, as the kernel writes it


def test_the_trainer_group_listens_on_loopback_only():
    port = free_port()
    init_parallel(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port, tp_size=1)
    try:
        assert _listening_addresses(port) == [IPV4_LOOPBACK]
    finally:
        destroy_parallel()


def test_a_store_on_a_port_the_os_chooses_listens_there_only():
    store, port = listening_store("127.0.0.1", 0, 1, 10.0)
    store.set("k", "v")
    assert _listening_addresses(port) == [IPV4_LOOPBACK] and store.get("k") == b"v"
