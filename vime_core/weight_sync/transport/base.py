"""The one interface every weight transport implements; `publish_weights` drives it through one
versioned update: prepare, stage (optional head start), start, send_bucket per bucket, finish(version),
abort (after a failure: the session closes with no version), close (always). After
`finish` returns every engine has loaded every bucket and reports `version`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from vime_core.engines.client import call_all
from vime_core.utils.timing import Stopwatch, timed

if TYPE_CHECKING:
    from vime_core.engines.client import EngineClient
    from vime_core.weight_sync.buckets import Bucket


class WeightTransport(ABC):
    """Moves buckets of HF-named tensors into running vLLM engines."""

    name: str = "base"

    def __init__(self) -> None:
        self.engines: list["EngineClient"] = []
        self.bytes_moved = False
        self.session_open = False
        self.timings: dict[str, float] = {}

    async def prepare(self, engines: list["EngineClient"]) -> None:
        self.engines = list(engines)

    def stage(self, bucket: "Bucket") -> None:
        """Optionally start preparing the first bucket while the engines are being paused; the
        same bucket then comes to `send_bucket` as usual. Default: nothing."""

    async def start(self) -> None:
        """Open every engine's weight-update session (vLLM's `start_weight_update`)."""
        await self.on_every_engine("start_weight_update")
        self.session_open = True

    @abstractmethod
    async def send_bucket(self, bucket: "Bucket") -> None: ...

    async def finish(self, version: int) -> None:
        """Close it: the engines finish loading and report `version` (timed as "finish")."""
        with self.timed("finish"):
            await self.on_every_engine("finish_weight_update", version)
            self.session_open = False

    async def abort(self) -> None:
        """Close the engines' session without setting a version. With no weights loaded, layerwise
        reload restores every layer's previous tensors; after a failure mid-transfer the layers
        loaded keep what they received (a half-applied update, which the next publish overwrites)."""
        if self.session_open:
            await self.on_every_engine("request", "POST", "/finish_weight_update", json={})
            self.session_open = False

    async def close(self) -> None:
        return None

    def timed(self, phase: str) -> AbstractContextManager[Stopwatch]:
        """`with self.timed("write"):` adds the block's seconds to `timings["write"]` (summed over
        the buckets of a publish)."""
        return timed(phase, self.timings)

    async def on_every_engine(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return await call_all(self.engines, method, *args, **kwargs)
