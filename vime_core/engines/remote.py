"""`RemoteEngine`: an engine actor (`EngineServer` as a detached Ray actor placed in its device
bundles, `vime_core/cluster/run_actors.py`) seen through the same blocking interface as a local
`EngineServer`, so the RolloutManager and the HealthMonitor use both alike.

Each call is one actor round trip; the URL is cached (it changes only on restart).
"""

from __future__ import annotations

from typing import Any, Optional


class RemoteEngine:
    attach_url = None  # launched by vime: the health monitor may restart it

    def __init__(self, actor: Any, index: int) -> None:
        self.actor = actor
        self.engine_index = index
        self.name = f"engine-{index}"
        self.url: Optional[str] = None

    def _call(self, method: str, *args: Any, timeout_s: Optional[float] = None) -> Any:
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout_s)

    def start(self) -> str:
        self.url = self._call("start")
        return self.url

    def restart(self) -> str:
        self.url = self._call("restart")
        return self.url

    def is_alive(self) -> bool:
        return bool(self._call("is_alive", timeout_s=30))

    def startup_marks(self) -> dict[str, Any]:
        return self._call("startup_marks", timeout_s=30)

    def process_exited(self) -> bool:
        return bool(self._call("process_exited", timeout_s=30))

    def memory(self) -> dict[str, Any]:
        return self._call("memory", timeout_s=60)

    def log_tail(self, lines: int = 40) -> str:
        return self._call("log_tail", lines)

    def shutdown(self, grace_s: float = 15.0) -> None:
        self._call("shutdown", grace_s)
