"""The one timer for the phases of a step: `with timed("t_train", record):` adds the block's
wall-clock seconds to `record["t_train"]`, as verl's `marked_timer`. Phases time themselves in
one `with` line instead of a pair of `perf_counter` calls."""

from __future__ import annotations

import time
from collections.abc import Iterator, MutableMapping
from contextlib import AbstractContextManager, contextmanager


class Stopwatch:
    """Wall-clock seconds since it was made; frozen once `stop()` is called."""

    __slots__ = ("_start", "_end")

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._end: float | None = None

    @property
    def seconds(self) -> float:
        """Seconds from start to stop, or to now while it runs (marks of a phase still running)."""
        end = self._end if self._end is not None else time.perf_counter()
        return end - self._start

    def stop(self) -> float:
        """Freeze the reading (a second stop keeps the first); returns the seconds."""
        if self._end is None:
            self._end = time.perf_counter()
        return self.seconds


@contextmanager
def timed(key: str | None = None, record: MutableMapping[str, float] | None = None) -> Iterator[Stopwatch]:
    """Time the block. Rule: when the block ends, normally or by an exception, its seconds are
    ADDED to `record[key]` (absent counts as 0.0), so a phase timed twice sums, as PhaseClock and
    verl's marked_timer do; the exception still propagates. A record kept after a caught error
    thus holds the seconds the failed phase spent; one built to be returned is simply not returned.

    Without a record, use the yielded Stopwatch where the value is returned rather than stored:
    `with timed() as watch: ...` then `watch.seconds` (frozen at the block's end)."""
    if record is not None and key is None:
        raise TypeError("timed: a record needs a key to store the seconds under")
    watch = Stopwatch()
    try:
        yield watch
    finally:
        watch.stop()
        if record is not None:
            record[key] = record.get(key, 0.0) + watch.seconds


class PhaseClock:
    """Seconds per named phase, summed (`seconds`), and seconds since the clock was made
    (`total()`): `with clock("transfer"):` is `timed("transfer", clock.seconds)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._since = Stopwatch()

    def __call__(self, phase: str) -> AbstractContextManager[Stopwatch]:
        return timed(phase, self.seconds)

    def total(self) -> float:
        return self._since.seconds
