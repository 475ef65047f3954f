"""One broadcast group across processes, for the `vime_broadcast` weight transports: rank 0 (the
trainer) sends a flat uint8 buffer, every engine worker receives it in place. Two carriers behind one
interface: NCCL through its C API with ctypes (so neither side needs the other's Python packages)
and gloo with a TCP store served by rank 0. Imports only torch and the standard library."""

from __future__ import annotations

import base64
import contextlib
import ctypes
import datetime
import functools
import glob
import os
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = ("127.0.0.1", "localhost", "::1")

NCCL_UNIQUE_ID_BYTES = 128
NCCL_UINT8 = 1  # ncclDataType_t: ncclInt8 = 0, ncclUint8 = 1


class BroadcastGroup:
    def broadcast(self, buffer: torch.Tensor) -> None:
        """Rank 0's `buffer` (1-D uint8, contiguous) into every other rank's; returns when this
        rank's part is complete."""
        raise NotImplementedError

    def abort(self) -> None:
        """Make a broadcast blocked on this rank return with an error; the group is unusable."""

    def close(self) -> None:
        """Free the group's resources (no collective)."""


def pooled_host_buffer(pool: list[torch.Tensor], index: int, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of host buffer `index` of `pool`, (re)allocated when missing or too
    small. Bucket i of a publish goes through buffer i of the last one, on both sides: a fresh
    host buffer of a bucket's size costs more in page faults than the copy into it (on CUDA the
    caching allocator reuses its blocks, so nothing is pooled there)."""
    if index < len(pool) and pool[index].numel() >= nbytes:
        return pool[index][:nbytes]
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    if index < len(pool):
        pool[index] = buffer
    else:
        pool.append(buffer)  # buckets come in index order, from 0
    return buffer


# -- gloo ---------------------------------------------------------------------------------------


class GlooGroup(BroadcastGroup):
    def __init__(self, store: Any, host: str, rank: int, world_size: int, timeout_s: float) -> None:
        options = dist.ProcessGroupGloo._Options()
        # A loopback rendezvous keeps the mesh on loopback; otherwise gloo takes this host's name
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1" if host in LOOPBACK else socket.gethostname())
        options._devices = [device]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        self._group = dist.ProcessGroupGloo(dist.PrefixStore("vime-broadcast", store), rank, world_size, options)

    def broadcast(self, buffer: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        self._group.broadcast([buffer], options).wait()

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        group, self._group = getattr(self, "_group", None), None
        if group is not None and hasattr(group, "abort"):
            try:
                group.abort()
            except Exception:  # already broken: nothing left to free
                pass


# torch's TCPStore master ignores the host it is given and listens on every interface (`::`): rank
# 0 binds the socket itself, on the rendezvous host only, and hands it to the store. The trainer's
# own process group uses these too (trainer/parallel.py).
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


def _serve_gloo_store(host: str, world_size: int, timeout_s: float) -> tuple[dict, Any]:
    """Rank 0's TCP store listening on `host` only (listening_store); port chosen by the OS."""
    store, port = listening_store(host, 0, world_size, timeout_s)
    return {"host": host, "port": port}, store


# -- nccl ---------------------------------------------------------------------------------------


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * NCCL_UNIQUE_ID_BYTES)]


@functools.lru_cache(maxsize=1)
def nccl_library() -> ctypes.CDLL:
    """libnccl: `VIME_NCCL_LIBRARY` when set, else the one torch loaded (a CUDA build of torch
    links it), else the `nvidia-nccl` wheel's copy on sys.path. Raises naming what was tried."""
    explicit = os.environ.get("VIME_NCCL_LIBRARY")
    candidates = [explicit] if explicit else ["libnccl.so.2"]
    if not explicit:
        for entry in sys.path:
            candidates += sorted(glob.glob(os.path.join(entry, "nvidia", "nccl", "lib", "libnccl.so*")))
    errors = []
    for path in candidates:
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
            continue
        _declare(lib)
        return lib
    raise RuntimeError(
        "vime_broadcast: no NCCL library could be loaded (the nccl carrier needs a CUDA build "
        "of torch; set VIME_NCCL_LIBRARY to its libnccl.so.2): " + "; ".join(errors)
    )


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetErrorString.argtypes = [i32]
    lib.ncclGetUniqueId.restype = i32
    lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
    lib.ncclCommInitRank.restype = i32
    lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ptr), i32, _UniqueId, i32]
    lib.ncclBroadcast.restype = i32
    lib.ncclBroadcast.argtypes = [ptr, ptr, ctypes.c_size_t, i32, i32, ptr, ptr]
    lib.ncclCommAbort.restype = i32
    lib.ncclCommAbort.argtypes = [ptr]
    lib.ncclCommDestroy.restype = i32
    lib.ncclCommDestroy.argtypes = [ptr]


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result != 0:
        raise RuntimeError(f"{call} failed: NCCL error {result} ({lib.ncclGetErrorString(result).decode()})")


def mint_nccl_unique_id() -> str:
    lib = nccl_library()
    uid = _UniqueId()
    _check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return base64.b64encode(bytes(uid.internal)).decode("ascii")


def init_comm_with_deadline(
    lib: Any, world_size: int, uid: "_UniqueId", rank: int, device: torch.device, timeout_s: float
) -> ctypes.c_void_p:
    """`ncclCommInitRank` that gives up after `timeout_s`. It blocks until every rank has joined
    and NCCL has no timeout of its own, so a peer that never comes (its process died, or it
    cannot reach rank 0's address) would hang this process: a vLLM worker inside
    `init_weight_transfer_engine`, the trainer inside its publish. The call runs in a daemon
    thread; past the deadline the caller gets TimeoutError, and a communicator that completes
    after that (a late peer) is destroyed by the thread instead of leaking."""
    comm = ctypes.c_void_p()
    done, state = threading.Event(), {"abandoned": False}
    guard = threading.Lock()

    def work() -> None:
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                state["code"] = lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            state["error"] = exc
        with guard:
            done.set()
            if state["abandoned"] and state.get("code") == 0:
                lib.ncclCommDestroy(comm)

    threading.Thread(target=work, name="vime-nccl-init", daemon=True).start()
    done.wait(timeout_s)
    with guard:
        if not done.is_set():
            state["abandoned"] = True
            raise TimeoutError(
                f"vime_broadcast: ncclCommInitRank (rank {rank} of {world_size}) did not complete in "
                f"{timeout_s:.0f} s: not every rank joined the group (a peer that died, or one that "
                "cannot reach rank 0's address: NCCL_SOCKET_IFNAME)"
            )
    if "error" in state:
        raise state["error"]
    _check(lib, state["code"], "ncclCommInitRank")
    return comm


class NcclGroup(BroadcastGroup):
    def __init__(
        self, unique_id_b64: str, rank: int, world_size: int, device: torch.device, timeout_s: float = 300.0
    ) -> None:
        self.timeout_s = timeout_s
        raw = base64.b64decode(unique_id_b64, validate=True)
        if len(raw) != NCCL_UNIQUE_ID_BYTES:
            raise ValueError(f"vime_broadcast: the NCCL unique id is {len(raw)} bytes, not {NCCL_UNIQUE_ID_BYTES}")
        self._lib = nccl_library()
        self.device = device
        uid = _UniqueId()
        ctypes.memmove(uid.internal, raw, NCCL_UNIQUE_ID_BYTES)
        self._comm: ctypes.c_void_p | None = init_comm_with_deadline(
            self._lib, world_size, uid, rank, device, timeout_s
        )

    def broadcast(self, buffer: torch.Tensor) -> None:
        if self._comm is None:
            raise RuntimeError("vime_broadcast: the NCCL group was aborted or closed")
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous() or buffer.device != self.device:
            raise ValueError(
                f"vime_broadcast: a buffer must be contiguous uint8 on {self.device}, got "
                f"{buffer.dtype} on {buffer.device}"
            )
        with torch.cuda.device(self.device):
            stream = torch.cuda.current_stream()
            ptr = ctypes.c_void_p(buffer.data_ptr())
            _check(
                self._lib,
                self._lib.ncclBroadcast(
                    ptr, ptr, buffer.numel(), NCCL_UINT8, 0, self._comm, ctypes.c_void_p(stream.cuda_stream)
                ),
                "ncclBroadcast",
            )
            done = torch.cuda.Event()
            done.record(stream)
        # A peer that died mid-broadcast would leave this rank's kernel waiting forever (NCCL has
        # no timeout of its own): wait with a deadline, then abort the communicator.
        deadline = time.monotonic() + self.timeout_s
        while not done.query():
            if time.monotonic() > deadline:
                self.abort()
                raise TimeoutError(
                    f"vime_broadcast: the NCCL broadcast of {buffer.numel()} bytes did not complete "
                    f"in {self.timeout_s:.0f} s (a peer gone?); the group was aborted"
                )
            time.sleep(0.0002)

    def abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._lib.ncclCommAbort(comm)

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            self._lib.ncclCommDestroy(comm)


# -- both ---------------------------------------------------------------------------------------


def serve_rendezvous(carrier: str, host: str, world_size: int, timeout_s: float = 300.0) -> tuple[dict, Any]:
    """Rank 0, before the others are told: (the descriptor for them, rank 0's local state for
    `open_group`)."""
    if carrier == "nccl":
        return {"unique_id": mint_nccl_unique_id()}, None
    if carrier == "gloo":
        return _serve_gloo_store(host, world_size, timeout_s)
    raise ValueError(f"vime_broadcast: unknown carrier {carrier!r}")


def open_group(
    carrier: str,
    rendezvous: dict,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float = 300.0,
    local: Any = None,
) -> BroadcastGroup:
    """Join the group (blocks until every rank has joined). `local`: what `serve_rendezvous`
    returned to rank 0.

    Rank 0 calls `serve_rendezvous` first and sends the descriptor to the others; then every rank calls
    this at about the same time. NCCL's bootstrap carries the connection: set NCCL_SOCKET_IFNAME where
    the default interface is not the one the nodes share."""
    if carrier == "nccl":
        return NcclGroup(rendezvous["unique_id"], rank, world_size, device, timeout_s)
    if carrier == "gloo":
        host, port = rendezvous["host"], int(rendezvous["port"])
        store = local if local is not None else joining_store(host, port, world_size, timeout_s)
        return GlooGroup(store, host, rank, world_size, timeout_s)
    raise ValueError(f"vime_broadcast: unknown carrier {carrier!r}")
