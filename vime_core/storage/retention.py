"""Retention: everything is kept by default; these remove batches on request. `prune_selection` says
which batches `BatchStore.prune` removes (a run, an age); `remove_orphans` removes what killed
writers and cut-short removals left (tmp/ uploads and unindexed objects older than a grace
period). A removal unlists a batch by its tombstone, which a concurrent compaction cannot undo
(index.py)."""

from __future__ import annotations

import datetime as dt
import functools
import logging
import operator
import re
from typing import Any

import pyarrow.compute as pc

from vime_core.storage import layout

log = logging.getLogger(__name__)

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_age(value: str | dt.timedelta) -> dt.timedelta:
    """`90s`, `30m`, `12h`, `7d`, `2w` (or a timedelta) -> timedelta."""
    if isinstance(value, dt.timedelta):
        return value
    match = _AGE.match(str(value))
    if not match:
        raise ValueError(f"age {value!r} is not a number followed by s, m, h, d or w (e.g. 7d)")
    return dt.timedelta(seconds=float(match.group(1)) * _UNIT_SECONDS[match.group(2)])


def cutoff_time(older_than: str | dt.timedelta | dt.datetime, now: dt.datetime | None = None) -> dt.datetime:
    """The UTC instant before which things count as old."""
    if isinstance(older_than, dt.datetime):
        return older_than if older_than.tzinfo else older_than.replace(tzinfo=dt.timezone.utc)
    return (now or dt.datetime.now(dt.timezone.utc)) - parse_age(older_than)


def prune_selection(
    run: str | None = None, older_than: str | dt.timedelta | dt.datetime | None = None
) -> pc.Expression:
    """The index rows (index.INDEX_SCHEMA) of the batches of `run` (all runs if None) created
    before `older_than` (any age if None), as a filter for `pyarrow.Table.filter`. At least one
    of the two must be given."""
    if run is None and older_than is None:
        raise ValueError("prune needs a run or an age (older_than): refusing to remove every batch")
    conditions = []
    if run is not None:
        conditions.append(pc.field("run") == layout.check_run(run))
    if older_than is not None:
        conditions.append(pc.field("created_at") < cutoff_time(older_than))
    return functools.reduce(operator.and_, conditions)


def prune(
    store: Any,
    run: str | None = None,
    older_than: str | dt.timedelta | dt.datetime | None = None,
    dry_run: bool = True,
) -> list:
    """`store.prune(run, older_than, dry_run)` (BatchStore.prune): the published batches of `run`
    created before `older_than` removed, or with dry_run only listed, as BatchRefs."""
    return store.prune(run=run, older_than=older_than, dry_run=dry_run)


def remove_orphans(store: Any, older_than: str | dt.timedelta = "1h", dry_run: bool = True) -> list[str]:
    """Keys of unpublished uploads and unindexed batch objects of `store` (a BatchStore) older
    than `older_than`, removed unless dry_run."""
    cutoff = cutoff_time(older_than).timestamp()
    published = set(store.index().column("key").to_pylist())
    candidates = store.location.list_with_times(layout.TMP) + store.location.list_with_times(layout.BATCHES)
    orphans = [key for key, mtime in candidates if key not in published and mtime is not None and mtime < cutoff]
    if not dry_run:
        for key in orphans:
            store.location.delete(key)
        log.info("removed %d orphaned objects from %s", len(orphans), store.location.describe())
    return orphans
