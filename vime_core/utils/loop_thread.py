"""An asyncio event loop that lives in its own daemon thread for the life of an object.

Why: the rollout manager's HTTP sessions (hundreds of keep-alive connections to the engines and
the router) are bound to one event loop. A fresh loop per rollout (`asyncio.run`) would close
and reopen every connection each iteration; one long-lived loop keeps them open.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "vime-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule `coro` on the loop; returns at once."""
        if self.loop.is_closed():
            coro.close()
            raise RuntimeError(f"{self._thread.name}: the event loop is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (its exception is raised here). If the
        waiting thread is interrupted, the coroutine is cancelled rather than left running."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel what is still scheduled, stop the loop and join its thread."""
        if self.loop.is_closed():
            return

        async def cancel_pending() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(cancel_pending(), self.loop).result(timeout_s)
            except Exception:  # a task that ignores cancellation must not block shutdown
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
