"""Retention: everything is kept by default; these remove batches on request.

`prune` removes published batches selected by run and/or age (created_at older than a cutoff):
first their manifests (they stop being visible), then their objects, then it recompacts the
index without them. `remove_orphans` removes what killed writers left behind: uploads under
tmp/ and batch objects no index entry points to, older than a grace period (a writer may be
between upload and publish right now).

Run neither concurrently with a compaction (index.py says why); writers may keep writing.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
from typing import TYPE_CHECKING

import pyarrow.compute as pc

from vime_core.storage import layout

if TYPE_CHECKING:
    from vime_core.storage.store import BatchRef, BatchStore

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


def prune(
    store: "BatchStore",
    run: str | None = None,
    older_than: str | dt.timedelta | dt.datetime | None = None,
    dry_run: bool = True,
) -> list["BatchRef"]:
    """Remove the published batches of `run` (all runs if None) created before `older_than`
    (any age if None). At least one of the two must be given. Returns the batches removed (or,
    with dry_run, that would be)."""
    if run is None and older_than is None:
        raise ValueError("prune needs a run or an age (older_than): refusing to remove every batch")
    index = store.index()
    keep_mask = None
    if run is not None:
        keep_mask = pc.equal(index.column("run"), layout.check_run(run))
    if older_than is not None:
        old = pc.less(index.column("created_at"), cutoff_time(older_than))
        keep_mask = old if keep_mask is None else pc.and_(keep_mask, old)
    selected = index.filter(keep_mask).to_pylist()
    refs = [store._ref(entry) for entry in selected]
    if dry_run or not selected:
        return refs
    for entry in selected:
        store.location.delete(layout.manifest_key(entry["run"], entry["rollout_id"], entry["checksum"]))
    for entry in selected:
        store.location.delete(entry["key"])
    store.batch_index.compact(drop_keys=frozenset(e["key"] for e in selected))
    log.info("pruned %d batches from %s", len(selected), store.location.describe())
    return refs


def remove_orphans(store: "BatchStore", older_than: str | dt.timedelta = "1h", dry_run: bool = True) -> list[str]:
    """Keys of unpublished uploads and unindexed batch objects older than `older_than`,
    removed unless dry_run."""
    cutoff = cutoff_time(older_than).timestamp()
    published = set(store.index().column("key").to_pylist())
    candidates = store.location.list_with_times(layout.TMP) + store.location.list_with_times(layout.BATCHES)
    orphans = [key for key, mtime in candidates
               if key not in published and mtime is not None and mtime < cutoff]
    if not dry_run:
        for key in orphans:
            store.location.delete(key)
        log.info("removed %d orphaned objects from %s", len(orphans), store.location.describe())
    return orphans
