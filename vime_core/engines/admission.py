"""The gate new generate requests wait at: open while nobody holds it. A weight sync holds it
from its start to its end; an engine restart holds it from before the restart until the trainer's
weights are published to the new engine, so no request reaches an engine still serving the
checkpoint's weights (requests already admitted finish or fail and wait here on their retry)."""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

SYNC = "sync"


class Admission:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: set[str] = set()
        self._open = threading.Event()
        self._open.set()

    def is_set(self) -> bool:
        """Whether new requests may go out (threading.Event's name: the rollout loop polls it)."""
        return self._open.is_set()

    def holders(self) -> set[str]:
        with self._lock:
            return set(self._holders)

    def hold(self, holder: str) -> None:
        """Close the gate for `holder` (holding twice is holding once)."""
        with self._lock:
            self._holders.add(holder)
            self._open.clear()

    def release(self, holder: str) -> None:
        """`holder` lets go; the gate opens when nobody else holds it."""
        with self._lock:
            self._holders.discard(holder)
            if not self._holders:
                self._open.set()

    @contextlib.contextmanager
    def held(self, holder: str) -> Iterator[None]:
        self.hold(holder)
        try:
            yield
        finally:
            self.release(holder)
