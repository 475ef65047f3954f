"""A long-lived event loop, in a daemon thread, that runs blocking publishes and keeps their
engine clients between them.

Why: an `EngineClient` is bound to the loop that first used it and keeps its connections open;
a publish run in a fresh loop each time would open new connections to every engine on every
publish. One loop per process (made on first use), like a connection pool.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

from vime_core.utils.loop_thread import LoopThread

if TYPE_CHECKING:
    from vime_core.engines.client import EngineClient


class PublishLoop(LoopThread):
    def __init__(self) -> None:
        super().__init__("vime-publish-loop")
        self._clients: dict[str, "EngineClient"] = {}

    def client(self, url: str) -> "EngineClient":
        """The cached client of `url`; only to be used by coroutines running on this loop."""
        from vime_core.engines.client import EngineClient

        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        return self._clients[url]


_LOOPS: dict[int, PublishLoop] = {}
_LOCK = threading.Lock()


def publish_loop() -> PublishLoop:
    """This process's loop (a forked child gets its own)."""
    with _LOCK:
        loop = _LOOPS.get(os.getpid())
        if loop is None:
            loop = _LOOPS[os.getpid()] = PublishLoop()
        return loop
