"""The index of all published batches: one Parquet manifest per batch, folded by `compact()`; the folder
is one Parquet dataset (pyarrow.dataset, DuckDB). `BatchIndex.table()` reads it consistently while
writers and compactions run: it lists the manifests before the compacted files (a compaction writes
its output before deleting what it folded), starts again if a listed file vanished, and keeps the
latest `published_at` per (run, rollout_id).

A batch leaves the index by a newer row of its own, a tombstone (`unpublished`), never by a
compaction leaving its row out: a compaction that read the index before the removal and writes its
file after it would bring the row back. The tombstone, newer than any row that compaction holds,
hides it whichever file it is in; compactions keep tombstones for TOMBSTONE_KEEP, far longer than
one can run."""

from __future__ import annotations

import datetime as dt
import io
import logging
from typing import Callable, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vime_core.storage import layout
from vime_core.storage.fs import StorageLocation
from vime_core.storage.schema import lineage_of
from vime_core.utils.retry import attempts

log = logging.getLogger(__name__)

INDEX_VERSION = 3  # 2: published_at; 3: unpublished
INDEX_SCHEMA = pa.schema(
    [
        pa.field("run", pa.string(), nullable=False),
        pa.field("rollout_id", pa.int64(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("created_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("published_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("num_rows", pa.int64(), nullable=False),
        pa.field("size_bytes", pa.int64(), nullable=False),
        pa.field("checksum", pa.string(), nullable=False),
        pa.field("schema_version", pa.int64(), nullable=False),
        pa.field("config_hash", pa.string()),
        pa.field("code_version", pa.string()),
        pa.field("model_id", pa.string()),
        pa.field("dataset_id", pa.string()),
        pa.field("flow_run_id", pa.string()),
        pa.field("weight_version_min", pa.int64()),
        pa.field("weight_version_max", pa.int64()),
        pa.field("weight_versions", pa.list_(pa.field("element", pa.int64()))),
        pa.field("prompt_ids", pa.list_(pa.field("element", pa.string()))),
        pa.field("reward_mean", pa.float64()),
        pa.field("response_length_mean", pa.float64()),
        pa.field("num_eval_rows", pa.int64()),
        pa.field("unpublished", pa.bool_(), nullable=False),  # a tombstone: the batch was removed
    ],
    metadata={"index_version": str(INDEX_VERSION)},
)

_READ_ATTEMPTS = 8
TOMBSTONE_KEEP = dt.timedelta(days=1)
T = TypeVar("T")


def _mean(column: pa.ChunkedArray) -> float | None:
    value = pc.mean(column).as_py() if len(column) else None
    return None if value is None else float(value)


def _published_now(after: dt.datetime | None) -> dt.datetime:
    """Now, or just after `after` (the batch's last row) where this machine's clock is behind the
    one that wrote that row: a batch's rows are ordered by `published_at`, whoever wrote them."""
    now = dt.datetime.now(dt.timezone.utc)
    return now if after is None else max(now, after + dt.timedelta(microseconds=1))


def index_row(table: pa.Table, key: str, size_bytes: int, after: dt.datetime | None = None) -> pa.Table:
    """The one-row index table describing stored batch `table` at `key`, published after `after`
    (the batch's last row, a tombstone included, if it has one).

    reward_mean is the mean raw (unnormalised) reward over scored samples: the normalised reward
    of GRPO averages to 0 in every group and says nothing about progress.
    """
    lineage = lineage_of(table)
    versions = [int(v) for v in lineage.get("weight_versions", [])]
    row = {
        "run": lineage["run"],
        "rollout_id": int(lineage["rollout_id"]),
        "key": key,
        "created_at": dt.datetime.fromisoformat(lineage["created_at"]).astimezone(dt.timezone.utc),
        # When this row was made: decides between two rows of one batch (an overwrite), whatever
        # created_at the caller put in the lineage.
        "published_at": _published_now(after),
        "num_rows": table.num_rows,
        "size_bytes": size_bytes,
        "checksum": lineage["checksum"],
        "schema_version": int(lineage["schema_version"]),
        "config_hash": lineage.get("config_hash", ""),
        "code_version": lineage.get("code_version", ""),
        "model_id": lineage.get("model_id", ""),
        "dataset_id": lineage.get("dataset_id", ""),
        "flow_run_id": lineage.get("flow_run_id", ""),
        "weight_version_min": min(versions) if versions else None,
        "weight_version_max": max(versions) if versions else None,
        "weight_versions": versions,
        "prompt_ids": [str(p) for p in lineage.get("prompt_ids", [])],
        "reward_mean": _mean(table.column("raw_reward")) if "raw_reward" in table.column_names else None,
        "response_length_mean": _mean(table.column("response_length"))
        if "response_length" in table.column_names
        else None,
        "num_eval_rows": int(pc.sum(table.column("is_eval")).as_py() or 0) if "is_eval" in table.column_names else 0,
        "unpublished": False,
    }
    return pa.Table.from_pylist([row], schema=INDEX_SCHEMA)


def tombstone_row(entry: dict) -> pa.Table:
    """The row that removes published batch `entry` (an index row as a dict) from the index: the
    same fields, published after it (`_published_now`), `unpublished` set."""
    row = {**entry, "published_at": _published_now(entry["published_at"]), "unpublished": True}
    return pa.Table.from_pylist([row], schema=INDEX_SCHEMA)


def _to_parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def published(table: pa.Table) -> pa.Table:
    """The batches an index table lists: `latest_per_batch`, tombstones left out."""
    latest = latest_per_batch(table)
    return latest.filter(pc.invert(latest.column("unpublished")))


def latest_per_batch(table: pa.Table) -> pa.Table:
    """One row per (run, rollout_id): the one published last, a tombstone included; sorted by run,
    rollout_id."""
    if table.num_rows == 0:
        return table
    table = table.sort_by([("run", "ascending"), ("rollout_id", "ascending"), ("published_at", "ascending")])
    runs, ids = table.column("run").combine_chunks(), table.column("rollout_id").combine_chunks()
    # A row is kept when the next row belongs to another batch (or it is the last row).
    differs = pc.or_(pc.not_equal(runs[1:], runs[:-1]), pc.not_equal(ids[1:], ids[:-1]))
    keep = pa.concat_arrays([differs, pa.array([True])])
    return table.filter(keep)


class BatchIndex:
    """Manifests + compacted files of one store (module docstring)."""

    def __init__(self, location: StorageLocation):
        self.location = location

    def publish(self, row: pa.Table) -> str:
        """Write the manifest of one verified batch: from now on readers see it."""
        run, rollout_id, checksum = row["run"][0].as_py(), row["rollout_id"][0].as_py(), row["checksum"][0].as_py()
        key = layout.manifest_key(run, rollout_id, checksum)
        self.location.put_atomic(key, _to_parquet(row))
        return key

    def unpublish(self, entry: dict) -> None:
        """Remove published batch `entry` (its index row) from the index: its tombstone's manifest,
        beside the batch's own (module docstring). Its manifest and object are the caller's."""
        key = layout.tombstone_key(entry["run"], entry["rollout_id"], entry["checksum"])
        self.location.put_atomic(key, _to_parquet(tombstone_row(entry)))

    def entry(self, run: str, rollout_id: int) -> dict | None:
        """The index row of (run, rollout_id) as a dict, or None when not published."""
        row = self.latest(run, rollout_id)
        return None if row is None or row["unpublished"] else row

    def latest(self, run: str, rollout_id: int) -> dict | None:
        """The last row of (run, rollout_id) as a dict, a tombstone included, or None.

        Reads only that batch's manifests and the compacted files, never every manifest: a
        published batch is in its own manifest or (once folded) in a compacted file. Manifests
        are listed before compacted files, for the reason the module docstring gives.
        """
        prefix = layout.manifest_prefix(run, rollout_id)

        def read_once() -> pa.Table:
            names = [k for k in self.location.list_keys(prefix.rsplit("/", 1)[0]) if k.startswith(prefix)]
            compacted = self.location.list_keys(layout.COMPACTED)
            return self._read(names + [k for k in compacted if k.endswith(".parquet")])

        rows = self._consistent(read_once)
        rows = latest_per_batch(
            rows.filter(pc.and_(pc.equal(rows.column("run"), run), pc.equal(rows.column("rollout_id"), rollout_id)))
        )
        return rows.to_pylist()[0] if rows.num_rows else None

    def _consistent(self, read_once: Callable[[], T]) -> T:
        """`read_once()`, run again (up to _READ_ATTEMPTS times in all) while a file it listed
        vanishes before it is read: a compaction folded it meanwhile (module docstring)."""
        retrying = attempts(
            _READ_ATTEMPTS,
            retry_on=lambda exc: isinstance(exc, FileNotFoundError),
            on_retry=lambda state: log.debug("index file vanished while reading (a compaction ran); reading again"),
        )
        try:
            return retrying(read_once)
        except FileNotFoundError:
            raise RuntimeError(
                f"index of {self.location.describe()} kept changing during {_READ_ATTEMPTS} reads"
            ) from None

    def _read(self, keys: list[str]) -> pa.Table:
        blobs = self.location.get_many(keys)
        tables = [_as_index_table(pq.read_table(io.BytesIO(blobs[k])), k) for k in keys]
        return pa.concat_tables(tables) if tables else INDEX_SCHEMA.empty_table()

    def snapshot(self) -> tuple[list[str], pa.Table]:
        """(keys read, all rows incl. duplicates), consistent as described in the module docstring."""

        def read_once() -> tuple[list[str], pa.Table]:
            manifests = self.location.list_keys(layout.MANIFESTS)
            compacted = self.location.list_keys(layout.COMPACTED)
            keys = [k for k in manifests + compacted if k.endswith(".parquet")]
            return keys, self._read(keys)

        return self._consistent(read_once)

    def table(self) -> pa.Table:
        """All published batches, one row each, sorted by run and rollout_id."""
        return published(self.snapshot()[1])

    def compact(self) -> pa.Table:
        """Fold every manifest and compacted file into one new compacted file; returns the
        published batches' rows."""
        return self.fold(*self.snapshot())

    def fold(self, read_keys: list[str], rows: pa.Table) -> pa.Table:
        """`compact`'s second half, on what its `snapshot` read: one compacted file with the latest
        row of each batch, tombstones younger than TOMBSTONE_KEEP among them; the files read go."""
        if all(k.startswith(layout.COMPACTED) for k in read_keys) and len(read_keys) <= 1:
            return published(rows)  # already one compacted file: nothing to fold
        rows = latest_per_batch(rows)
        expired = dt.datetime.now(dt.timezone.utc) - TOMBSTONE_KEEP
        rows = rows.filter(pc.or_(pc.invert(rows.column("unpublished")), pc.greater(rows["published_at"], expired)))
        if rows.num_rows or read_keys:
            self.location.put_atomic(layout.compacted_key(), _to_parquet(rows))
        for key in read_keys:
            self.location.delete(key)
        log.info("compacted %d index files into %d rows at %s", len(read_keys), rows.num_rows, self.location.describe())
        return published(rows)


def _as_index_table(table: pa.Table, key: str) -> pa.Table:
    """One index file as INDEX_SCHEMA, upgraded when an older vime wrote it, or an error naming
    the file: never half-read.

    Index version 1 (and files without a stamp) had the fields of version 2 without
    `published_at`; files stamped 1 after that field was added carry it. A version-1 file is read
    with its `published_at` when it has one, else `created_at` (the batch's creation time: the
    order in which re-published batches replaced each other is kept, as a re-publish is always of
    a newer batch). Versions 1 and 2 had no tombstones: `unpublished` is false in every row. Any
    other layout or a newer version is refused; the next compaction rewrites what was upgraded in
    the current version.
    """
    stamp = (table.schema.metadata or {}).get(b"index_version", b"?").decode()
    names = table.schema.names
    if stamp in ("1", "?") and "published_at" not in names and "created_at" in names:
        table = table.add_column(names.index("created_at") + 1, "published_at", table.column("created_at"))
        names = table.schema.names
    if stamp in ("1", "?", "2") and "unpublished" not in names:
        table = table.append_column("unpublished", pa.array([False] * table.num_rows, pa.bool_()))
        names = table.schema.names
    if stamp in ("1", "?", "2", str(INDEX_VERSION)) and names == INDEX_SCHEMA.names:
        return table.cast(INDEX_SCHEMA)
    why = (
        f"a newer vime (index version {stamp})"
        if stamp.isdigit() and int(stamp) > INDEX_VERSION
        else f"index version {stamp} with fields {table.schema.names}"
    )
    raise ValueError(
        f"index file {key} was written by {why}; this vime reads index version {INDEX_VERSION} "
        f"({INDEX_SCHEMA.names}) and versions 1 and 2: read it with the vime that wrote it, or move it "
        f"away (the batches it lists then leave the index; their objects stay readable by key)"
    )
