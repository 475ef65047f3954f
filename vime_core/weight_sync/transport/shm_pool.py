"""Bucket files on a tmpfs, kept mapped between publishes so their pages are allocated once (a fresh
tmpfs page faults and is zeroed, which costs more than the copy). Bucket k of every publish reuses file
`vime-wb-<pid>-<k>`, safe because engines let go of their mappings when a session starts and ends.
The pool holds one copy of the wire bytes between publishes; `release()` gives it back, and files
of dead processes are removed when the next pool for the folder is made."""

from __future__ import annotations

import glob
import mmap
import os
import re
import threading
import uuid

import torch

from vime_core.utils.processes import pid_alive
from vime_core.wire.shm_format import FILE_PREFIX


class ShmBufferPool:
    """One growable, mapped file per bucket slot in `shm_dir`."""

    def __init__(self, shm_dir: str) -> None:
        if not os.path.isdir(shm_dir):
            raise FileNotFoundError(f"shm transport: {shm_dir!r} (shared-memory folder) does not exist")
        self.shm_dir = shm_dir
        self.lock = threading.Lock()  # one publish at a time writes the pool
        # True while no engine maps a slot: after a session finished or closed empty. A bucket
        # may be written before the next session starts only then.
        self.clean = True
        self._slots: dict[int, tuple[str, mmap.mmap, torch.Tensor]] = {}
        self._name = f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        remove_stale_files(shm_dir)

    def buffer(self, slot: int, nbytes: int) -> tuple[str, torch.Tensor]:
        """(path, uint8 tensor of `nbytes` mapped onto the slot's file), growing the file if needed."""
        current = self._slots.get(slot)
        if current is not None and current[2].numel() >= nbytes:
            return current[0], current[2][:nbytes]
        path = self.path_of(slot)
        if current is not None:
            self._unmap(slot)
        size = max(nbytes, 1)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            # MAP_POPULATE allocates all pages in one call instead of one fault per page.
            mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=size)
        self._slots[slot] = (path, mapped, flat)
        return path, flat[:nbytes]

    def path_of(self, slot: int) -> str:
        """The file of `slot`: <shm_dir>/vime-wb-<pid>-<this pool's name>-<slot>."""
        return os.path.join(self.shm_dir, f"{self._name}-{slot:05d}")

    def paths(self) -> list[str]:
        return [self._slots[k][0] for k in sorted(self._slots)]

    def nbytes(self) -> int:
        return sum(flat.numel() for _, _, flat in self._slots.values())

    def release(self) -> None:
        """Unmap and delete every file of the pool."""
        for slot in list(self._slots):
            path = self._slots[slot][0]
            self._unmap(slot)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _unmap(self, slot: int) -> None:
        _, mapped, _ = self._slots.pop(slot)
        try:
            mapped.close()
        except BufferError:  # a caller still holds a view; the GC unmaps it later
            pass


_STALE = re.compile(re.escape(FILE_PREFIX) + r"(\d+)-(?:[0-9a-f]+-)?\d+$")  # pid-pool-slot (older: pid-slot)


def remove_stale_files(shm_dir: str) -> list[str]:
    """Delete pool files in `shm_dir` whose owning process no longer exists."""
    removed = []
    for path in glob.glob(os.path.join(shm_dir, FILE_PREFIX + "*")):
        match = _STALE.match(os.path.basename(path))
        if match and not pid_alive(int(match.group(1))):
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed
