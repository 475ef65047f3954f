"""What a publisher keeps between publishes, so connections, tmpfs pages and broadcast groups are made
once: a long-lived event loop in a daemon thread, the engine clients bound to it, the shared-memory
bucket pools and the broadcast groups. The trainer (rank 0) owns one; a publish given none makes its
own. Its clients send the token it was made with, else its token source's answer at
each publish (the engines may have been replaced)."""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING, Callable, Optional

from vime_core.engines.client import EngineClient
from vime_core.utils.loop_thread import LoopThread
from vime_core.weight_sync.transport.shm_pool import ShmBufferPool

if TYPE_CHECKING:
    from vime_core.engines.auth import EngineToken
    from vime_core.engines.client import EngineClient
    from vime_core.weight_sync.transport.broadcast import KeptGroup
    from vime_core.weight_sync.transport.shm_pool import ShmBufferPool


class PublishLoop(LoopThread):
    def __init__(
        self, token: "EngineToken | None" = None, token_source: "Callable[[], Optional[EngineToken]] | None" = None
    ) -> None:
        super().__init__("vime-publish-loop")
        self._token = token
        self._token_source = token_source
        self._clients: dict[str, "EngineClient"] = {}
        self._pools: dict[str, "ShmBufferPool"] = {}
        self._groups: dict[str, "KeptGroup"] = {}
        atexit.register(self.close)  # a process that ends without close() still gives its pools back

    def engine_token(self) -> "EngineToken | None":
        """The token to send: this loop's own, else its token source's (None without either)."""
        if self._token is not None:
            return self._token
        return self._token_source() if self._token_source is not None else None

    def client(self, url: str, token: "EngineToken | None" = None) -> "EngineClient":
        """The cached client of `url`, sending `token`; only to be used by coroutines running on
        this loop."""
        if url not in self._clients:
            self._clients[url] = EngineClient(url)
        client = self._clients[url]
        client.token = token  # the run's token may have changed since the last publish (module docstring)
        return client

    def shm_pool(self, shm_dir: str) -> "ShmBufferPool":
        """The bucket pool of `shm_dir` kept for this publisher's publishes (made on first use)."""
        key = os.path.realpath(shm_dir)
        if key not in self._pools:
            self._pools[key] = ShmBufferPool(shm_dir)
        return self._pools[key]

    def broadcast_group(self, carrier: str) -> "KeptGroup | None":
        """The broadcast group formed over `carrier` for this publisher's engines, if any."""
        return self._groups.get(carrier)

    def keep_broadcast_group(self, carrier: str, kept: "KeptGroup | None") -> None:
        """Keep `kept` for the next publishes (None: forget the one kept; its owner closes it)."""
        if kept is None:
            self._groups.pop(carrier, None)
        else:
            self._groups[carrier] = kept

    def release_pools(self) -> None:
        """Give the pools' shared memory back now (e.g. before a memory-hungry phase); the next
        publish makes new ones."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.release()

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the engine clients' connections, release the pools, close the broadcast groups
        and stop the loop."""
        atexit.unregister(self.close)
        clients, self._clients = list(self._clients.values()), {}
        if clients and not self.loop.is_closed():

            async def close_clients() -> None:
                for client in clients:
                    await client.aclose()

            try:
                self.run(close_clients())
            except Exception:  # an engine already gone must not block the rest of the shutdown
                pass
        self.release_pools()
        groups, self._groups = list(self._groups.values()), {}
        for kept in groups:
            kept.group.close()
        super().close(timeout_s)
