"""BatchStore: atomic, verified writes and reads of rollout batches (layout in layout.py). A write goes
to a temporary key, is read back and verified, moved, and published by its manifest: a killed writer
leaves no visible batch, and writers of different batches can run concurrently. A read verifies the
checksum against the table and the index and raises CorruptBatchError rather than return a mismatch."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from vime_core.storage import layout
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.fs import StorageLocation, open_location
from vime_core.storage.index import BatchIndex, index_row
from vime_core.storage.retention import prune_selection
from vime_core.storage.schema import (
    batch_to_table,
    lineage_of,
    table_checksum,
    table_to_batch,
    upgrade_table,
)

log = logging.getLogger(__name__)


class CorruptBatchError(RuntimeError):
    """A stored batch failed verification; `key` names the object. It must not be used."""

    def __init__(self, key: str, detail: str):
        super().__init__(f"stored batch {key} is corrupt: {detail}")
        self.key = key
        self.detail = detail

    def __reduce__(self):  # crosses Ray (pickle) with its own arguments, not the message
        return type(self), (self.key, self.detail)


class BatchNotFoundError(LookupError):
    """No published batch for (run, rollout_id)."""


class BatchExistsError(FileExistsError):
    """A batch for (run, rollout_id) is already published and overwrite was not asked for."""


@dataclass(frozen=True)
class BatchRef:
    """Where a published batch is and what it is."""

    run: str
    rollout_id: int
    key: str
    uri: str
    checksum: str
    num_rows: int
    created_at: str


# Dictionary-encoding the token, mask and log-prob lists and collecting statistics on them
# cost time on every write and read for nothing (bench/bench_persist.py, docs/measurements.md);
# zstd gives the smallest files at about snappy's speed.
PARQUET_OPTIONS = {
    "compression": "zstd",
    "use_dictionary": ["prompt_id", "status", "finish_reason"],
    "write_statistics": ["group_index", "index", "prompt_length", "response_length", "total_length", "raw_reward"],
}


def _parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, **PARQUET_OPTIONS)
    return sink.getvalue().to_pybytes()


def verify_table(data: bytes, key: str, expected_checksum: str | None = None) -> pa.Table:
    """The table in Parquet `data`, after checking its checksum; CorruptBatchError otherwise."""
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as exc:
        raise CorruptBatchError(key, f"not readable as Parquet ({exc})") from None
    stored = lineage_of(table).get("checksum")
    if not stored:
        raise CorruptBatchError(key, "no checksum in its metadata")
    actual = table_checksum(table)
    if actual != stored:
        raise CorruptBatchError(key, f"content checksum {actual[:16]}... differs from its recorded {stored[:16]}...")
    if expected_checksum is not None and stored != expected_checksum:
        raise CorruptBatchError(key, f"checksum {stored[:16]}... differs from the index's {expected_checksum[:16]}...")
    return table


class BatchStore:
    """Rollout batches of every run under one URI (a local folder or s3://bucket/prefix)."""

    def __init__(self, uri: str = "runs", storage_options: dict | None = None, endpoint: "S3Endpoint | None" = None):
        self.uri = uri
        self.location: StorageLocation = open_location(uri, storage_options, endpoint)
        self.batch_index = BatchIndex(self.location)

    @classmethod
    def for_config(cls, cfg) -> "BatchStore":
        """The store of a run: cfg.storage_uri at the configuration's S3 endpoint."""
        return cls(cfg.storage_uri, endpoint=S3Endpoint.of(cfg))

    def __repr__(self) -> str:
        return f"BatchStore({self.location.describe()!r})"

    # ---- writing ------------------------------------------------------------------------------
    def write(self, batch: dict[str, list], lineage: dict, overwrite: bool = False) -> BatchRef:
        """Store `batch` with `lineage` (keys: schema.LINEAGE_KEYS; run and rollout_id required).

        Raises BatchExistsError when (run, rollout_id) is already published, unless `overwrite`
        (the old object is then deleted once the new one is published).
        """
        table = batch_to_table(batch, lineage)
        full = lineage_of(table)
        run, rollout_id, checksum = layout.check_run(full["run"]), full["rollout_id"], full["checksum"]
        latest = self.batch_index.latest(run, rollout_id)  # a removed batch's: its tombstone
        previous = latest if latest is not None and not latest["unpublished"] else None
        if previous is not None and not overwrite:
            raise BatchExistsError(
                f"batch {run}/{rollout_id} is already stored at {previous['key']}; pass overwrite=True to replace it"
            )
        data = _parquet_bytes(table)
        tmp = layout.tmp_key(run, rollout_id)
        final = layout.batch_key(run, rollout_id, checksum)
        self.location.put(tmp, data)
        try:
            verify_table(self.location.get(tmp), tmp, checksum)
            after = latest["published_at"] if latest is not None else None
            self._publish(tmp, final, index_row(table, final, len(data), after))
        except BaseException:
            self.location.delete(tmp)
            raise
        if previous is not None and previous["key"] != final:
            self._forget(previous)
        log.info(
            "stored batch %s/%d (%d rows, %d bytes) at %s",
            run,
            rollout_id,
            table.num_rows,
            len(data),
            self.location.url(final),
        )
        return BatchRef(run, rollout_id, final, self.location.url(final), checksum, table.num_rows, full["created_at"])

    def _publish(self, tmp: str, final: str, row: pa.Table) -> None:
        """Move the verified upload to its final key, then write its manifest (the publish point)."""
        self.location.move(tmp, final)
        self.batch_index.publish(row)

    def _forget(self, entry: dict) -> None:
        """Delete a replaced batch: its manifest first (it stops being visible), then the object."""
        self.location.delete(layout.manifest_key(entry["run"], entry["rollout_id"], entry["checksum"]))
        self.location.delete(entry["key"])

    # ---- reading ------------------------------------------------------------------------------
    def exists(self, run: str, rollout_id: int) -> bool:
        """True when (run, rollout_id) is published (its object is not read)."""
        return self.batch_index.entry(layout.check_run(run), layout.check_rollout_id(rollout_id)) is not None

    def ref(self, run: str, rollout_id: int) -> BatchRef:
        entry = self._entry(run, rollout_id)
        return self._ref(entry)

    def read_table(self, run: str, rollout_id: int) -> pa.Table:
        """The verified table of (run, rollout_id), upgraded to the current schema version."""
        entry = self._entry(run, rollout_id)
        try:
            data = self.location.get(entry["key"])
        except FileNotFoundError:
            raise BatchNotFoundError(
                f"batch {run}/{rollout_id} is in the index but its object {entry['key']} is gone (pruned?)"
            ) from None
        try:
            table = verify_table(data, entry["key"], entry["checksum"])
        except CorruptBatchError as exc:
            log.error("%s; it will not be used (replace it with write(..., overwrite=True) or prune it)", exc)
            raise
        return upgrade_table(table, source=f"stored batch {entry['key']}")

    def read(self, run: str, rollout_id: int) -> tuple[dict[str, list], dict]:
        """(batch dict, lineage) of a published batch, verified (see module docstring)."""
        return table_to_batch(self.read_table(run, rollout_id))

    def _entry(self, run: str, rollout_id: int) -> dict:
        entry = self.batch_index.entry(layout.check_run(run), layout.check_rollout_id(rollout_id))
        if entry is None:
            raise BatchNotFoundError(f"no published batch {run}/{rollout_id} in {self.location.describe()}")
        return entry

    def _ref(self, entry: dict) -> BatchRef:
        return BatchRef(
            entry["run"],
            entry["rollout_id"],
            entry["key"],
            self.location.url(entry["key"]),
            entry["checksum"],
            entry["num_rows"],
            entry["created_at"].isoformat(),
        )

    # ---- quarantine ---------------------------------------------------------------------------
    def quarantine(self, run: str, rollout_id: int, reason: str) -> dict:
        """Keep the published batch (run, rollout_id) aside under `quarantine/`, with a record of
        `reason`; it stays published until a new batch for the id is written with
        overwrite=True (so a crash in between finds it again and quarantines it again).
        Returns the record."""
        entry = self._entry(run, rollout_id)
        dst = layout.quarantine_key(run, rollout_id, entry["checksum"])
        try:
            data = self.location.get(entry["key"])
        except FileNotFoundError:
            data = None  # the object is gone: the record alone says what was wrong
        if data is not None:
            self.location.put(dst, data)
        record = {
            "run": run,
            "rollout_id": int(rollout_id),
            "key": entry["key"],
            "checksum": entry["checksum"],
            "quarantined_key": dst if data is not None else None,
            "reason": reason,
            "quarantined_at": dt.datetime.now(dt.timezone.utc).isoformat(),
        }
        self.location.put(dst.removesuffix(".parquet") + ".json", json.dumps(record, sort_keys=True).encode())
        log.warning("quarantined batch %s/%d (%s) at %s: %s", run, rollout_id, entry["key"], dst, reason)
        return record

    def discard(self, run: str, rollout_id: int, reason: str) -> dict:
        """Quarantine the published batch (run, rollout_id) with `reason` (its copy and record
        under `quarantine/`), then unpublish it: its manifest, its object and its index row go,
        so the rollout is generated again. The run guard's, for a batch it rejected. Returns the
        quarantine record."""
        record = self.quarantine(run, rollout_id, reason)
        entry = self._entry(run, rollout_id)
        # the index row goes first (its tombstone): a failure after it leaves an unindexed object
        # (remove_orphans'), never a published batch whose object is gone
        self.batch_index.unpublish(entry)
        self._forget(entry)
        return record

    def quarantined(self, run: str | None = None) -> list[dict]:
        """The quarantine records (of `run`, or all), by run then rollout id."""
        prefix = f"{layout.QUARANTINE}/{layout.check_run(run)}" if run else layout.QUARANTINE
        keys = [k for k in self.location.list_keys(prefix) if k.endswith(".json")]
        records = [json.loads(self.location.get(k)) for k in keys]
        return sorted(records, key=lambda r: (r["run"], r["rollout_id"], r["quarantined_at"]))

    # ---- the index --------------------------------------------------------------------------
    def index(self) -> pa.Table:
        """Every published batch of every run, one row each (index.INDEX_SCHEMA)."""
        return self.batch_index.table()

    def list_batches(self, run: str | None = None) -> list[BatchRef]:
        """Published batches (of `run`, or all), by run then rollout id."""
        rows = self.index().to_pylist()
        return [self._ref(r) for r in rows if run is None or r["run"] == run]

    def compact(self) -> int:
        """Fold the manifests into one compacted index file; returns the number of batches."""
        return self.batch_index.compact().num_rows

    def prune(
        self, run: str | None = None, older_than: "str | dt.timedelta | dt.datetime | None" = None, dry_run: bool = True
    ) -> list[BatchRef]:
        """Remove the published batches of `run` (all runs if None) created before `older_than`
        (any age if None; at least one of the two: retention.prune_selection): first their
        tombstones go into the index (they stop being visible, whether their rows were in
        manifests or in compacted files), then their manifests and objects, and a compaction
        folds what is left. A failure in between leaves unindexed objects
        (retention.remove_orphans), never a listed batch without its object. Returns the batches
        removed (or, with dry_run, that would be)."""
        selection = prune_selection(run, older_than)
        selected = self.index().filter(selection).to_pylist()
        refs = [self._ref(entry) for entry in selected]
        if dry_run or not selected:
            return refs
        for entry in selected:
            self.batch_index.unpublish(entry)
        for entry in selected:
            self._forget(entry)
        self.batch_index.compact()
        log.info("pruned %d batches from %s", len(selected), self.location.describe())
        return refs

    list = list_batches  # noqa: A003 - the name docs/interfaces.md gives it
