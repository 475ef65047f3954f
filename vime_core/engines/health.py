"""Engine health monitoring: a background thread finds a dead engine (its process exited, or
`failures_to_restart` failed checks in a row), restarts it, gives it the current weights
(`on_restarted`) and puts it back behind the router, new requests held meanwhile (`holding`); the
rollout loop retries what was in flight.
Paused while engines sleep; an engine whose wake failed part-way is condemned and restarted."""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable, ContextManager, Optional, Sequence

logger = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(
        self,
        servers: Sequence[object],
        on_restarted: Optional[Callable[[int, str], None]] = None,
        on_url_changed: Optional[Callable[[str, str], None]] = None,
        holding: Optional[Callable[[int], ContextManager[None]]] = None,
        interval_s: float = 2.0,
        failures_to_restart: int = 3,
    ) -> None:
        self.servers = list(servers)
        self.on_restarted = on_restarted
        self.on_url_changed = on_url_changed
        self.holding = holding or (lambda index: contextlib.nullcontext())
        self.interval_s = interval_s
        self.failures_to_restart = failures_to_restart
        self.restarts = 0
        self.errors: list[str] = []
        self._failures = [0] * len(self.servers)
        self._condemned: dict[int, str] = {}  # engine index -> why it must be restarted
        self.restart_errors: dict[int, str] = {}  # engine index -> why its last restart failed
        self._active = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()  # one check/restart at a time (check_now from other threads)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine-health", daemon=True)
            self._thread.start()
        self.resume()

    def pause(self) -> None:
        self._active.clear()

    def resume(self) -> None:
        self._active.set()

    @property
    def paused(self) -> bool:
        return not self._active.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._active.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._active.wait()
            if self._stop.is_set():
                return
            self.check_now()
            self._stop.wait(self.interval_s)

    def condemn(self, index: int, why: str) -> None:
        """Engine `index` is restarted by the next pass, although it answers."""
        self._condemned[index] = why

    def condemned(self, index: int) -> Optional[str]:
        """Why engine `index` awaits a restart, or None."""
        return self._condemned.get(index)

    def condemned_engines(self) -> dict[int, str]:
        return dict(self._condemned)

    def check_now(self, even_paused: bool = False) -> int:
        """One pass over the engines; returns how many were restarted. A paused monitor makes no
        pass unless `even_paused`."""
        restarted = 0
        with self._lock:
            for i, server in enumerate(self.servers):
                if self._stop.is_set() or (self.paused and not even_paused):
                    break
                if getattr(server, "attach_url", None):
                    continue  # not ours to restart
                condemned = i in self._condemned
                if not condemned and self._alive(server):
                    self._failures[i] = 0
                    continue
                self._failures[i] += 1
                if condemned or self._exited(server) or self._failures[i] >= self.failures_to_restart:
                    restarted += self._restart(i, server)
        return restarted

    @staticmethod
    def _exited(server: object) -> bool:
        try:
            return bool(server.process_exited())  # type: ignore[attr-defined]
        except Exception:  # an engine actor that cannot answer is as good as gone
            return True

    @staticmethod
    def _alive(server: object) -> bool:
        try:
            return bool(server.is_alive())  # type: ignore[attr-defined]
        except Exception:
            return False

    def _restart(self, index: int, server: object) -> int:
        old_url = server.url  # type: ignore[attr-defined]
        logger.warning("engine %d at %s: %s; restarting", index, old_url, self._condemned.get(index, "dead"))
        try:
            # held from before the restart to after the publish: the router may admit the new
            # server on its old URL as soon as it answers, before it holds the trainer's weights
            with self.holding(index):
                new_url = server.restart()  # type: ignore[attr-defined]
                if self.on_restarted is not None:
                    self.on_restarted(index, new_url)
                if self.on_url_changed is not None:
                    self.on_url_changed(old_url, new_url)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"[:2000]
            logger.error("engine %d: restart failed: %s", index, why)
            self.errors.append(f"engine {index}: restart failed: {why}")
            self.restart_errors[index] = why
            return 0
        self._failures[index] = 0
        self._condemned.pop(index, None)
        self.restart_errors.pop(index, None)
        self.restarts += 1
        logger.warning("engine %d restarted at %s", index, new_url)
        return 1
