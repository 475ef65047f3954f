"""A long-lived event loop, in a daemon thread, that runs blocking publishes and keeps their
engine clients between them.

Why: a new httpx client loads the CA bundle (~40-80 ms on the project's VM, measured), and an
`EngineClient` is bound to the loop that first used it, so a publish run in a fresh loop each
time would pay that per engine per publish, about a fifth of a 100M-parameter publish.
One loop per process (made on first use), like a connection pool.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vime_core.engines.client import EngineClient

T = TypeVar("T")


class PublishLoop:
    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vime-publish-loop", daemon=True)
        self._thread.start()
        self._clients: dict[str, "EngineClient"] = {}

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
