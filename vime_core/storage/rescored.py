"""Rewards of stored samples scored again (`vime rescore`), kept beside the batches, never in them:
a stored batch and its checksum stay as written. Version 1 of a run's rewards is what its batches
hold; each re-scoring adds the next version, one side table per rollout id:

    rescored/<run>/v<N>/<rollout_id:08d>.parquet   one row per sample of the batch, in its order,
                                                   keyed by (group_index, index): RESCORED_SCHEMA
    rescored/<run>/v<N>/rescore.json               the version's lineage, written last (the
                                                   publish point): reward function, sha256 of its
                                                   source, the run's own reward, rollout ids, time

Each side table's metadata holds the stored batch's checksum it was scored from: a batch replaced
since (overwrite) refuses its side table. `apply_rescored(batch, table)` gives the batch as if its
rollout had been scored by that version: raw_reward, reward, advantage, status and loss_mask
replaced, everything else (tokens, log-probs, lineage) as stored.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq

from vime_core.storage import layout
from vime_core.storage.fs import StorageLocation
from vime_core.storage.schema import table_checksum

RESCORED = "rescored"
LINEAGE_FILE = "rescore.json"
_VERSION = re.compile(r"^v(\d+)$")

RESCORED_SCHEMA = pa.schema(
    [
        pa.field("group_index", pa.int64(), nullable=False),
        pa.field("index", pa.int64(), nullable=False),
        pa.field("raw_reward_before", pa.float64()),
        pa.field("raw_reward", pa.float64()),
        pa.field("reward_before", pa.float64()),
        pa.field("reward", pa.float64()),
        pa.field("advantage_before", pa.float64()),
        pa.field("advantage", pa.float64()),
        pa.field("status_before", pa.string(), nullable=False),
        pa.field("status", pa.string(), nullable=False),
        pa.field("loss_mask", pa.list_(pa.field("element", pa.int8())), nullable=False),
        pa.field("reward_error_type", pa.string()),
    ]
)
# the batch columns a version replaces (apply_rescored)
REPLACED = ("raw_reward", "reward", "advantage", "status", "loss_mask")


class RescoreError(ValueError):
    """A side table that cannot serve the batch asked for; the message names it and why."""


def version_key(run: str, version: int, name: str = LINEAGE_FILE) -> str:
    return f"{RESCORED}/{layout.check_run(run)}/v{int(version)}/{name}"


def table_key(run: str, version: int, rollout_id: int) -> str:
    return version_key(run, version, f"{layout.check_rollout_id(rollout_id):08d}.parquet")


def versions(location: StorageLocation, run: str) -> dict[int, dict]:
    """The published re-scorings of `run`: version -> its lineage (rescore.json), by version."""
    prefix = f"{RESCORED}/{layout.check_run(run)}"
    found = {}
    for key in location.list_keys(prefix):
        parts = key[len(prefix) + 1 :].split("/")
        match = _VERSION.match(parts[0]) if len(parts) == 2 and parts[1] == LINEAGE_FILE else None
        if match:
            found[int(match.group(1))] = json.loads(location.get(key))
    return dict(sorted(found.items()))


def next_version(location: StorageLocation, run: str) -> int:
    """The version the next re-scoring of `run` gets: 2 for the first (1 is the stored rewards),
    then one more than any version folder (one that stopped before publishing keeps its number and
    is never listed)."""
    prefix = f"{RESCORED}/{layout.check_run(run)}"
    folders = [key[len(prefix) + 1 :].split("/")[0] for key in location.list_keys(prefix)]
    return max([1, *(int(m.group(1)) for f in folders if (m := _VERSION.match(f)))]) + 1


def write_table(
    location: StorageLocation, run: str, version: int, rollout_id: int, rows: dict, batch_checksum: str
) -> str:
    """Store one rollout's side table (`rows`: RESCORED_SCHEMA's columns); returns its key."""
    table = pa.Table.from_pydict(rows, schema=RESCORED_SCHEMA)
    meta = {b"batch_checksum": batch_checksum.encode(), b"rollout_id": str(rollout_id).encode()}
    table = table.replace_schema_metadata(meta)
    table = table.replace_schema_metadata({**meta, b"checksum": table_checksum(table).encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    key = table_key(run, version, rollout_id)
    location.put_atomic(key, sink.getvalue().to_pybytes())
    return key


def publish(location: StorageLocation, run: str, version: int, lineage: dict) -> str:
    """Write the version's lineage, after every side table: from now on it is listed and replayable."""
    key = version_key(run, version)
    stamped = {**lineage, "version": version, "published_at": dt.datetime.now(dt.timezone.utc).isoformat()}
    location.put_atomic(key, (json.dumps(stamped, indent=2, sort_keys=True) + "\n").encode())
    return key


def resolve_version(location: StorageLocation, run: str, rollout_id: int, which: str) -> int | None:
    """The version whose rewards replay trains `rollout_id` on: `which` = "stored" (None: the
    batch's own), "rescored" (the newest published version that scored it, else None) or "v<N>"
    (that version, which must have scored it)."""
    if which == "stored":
        return None
    published = versions(location, run)
    if which == "rescored":
        having = [v for v, lineage in published.items() if rollout_id in lineage.get("rollout_ids", [])]
        return having[-1] if having else None
    match = _VERSION.match(which)
    if not match or int(match.group(1)) not in published:
        raise RescoreError(
            f"--rewards {which}: run {run!r} has re-scored versions {[f'v{v}' for v in published]} "
            f"(or give stored, rescored)"
        )
    version = int(match.group(1))
    if rollout_id not in published[version].get("rollout_ids", []):
        raise RescoreError(f"--rewards {which}: rollout {rollout_id} of run {run!r} is not in that re-scoring")
    return version


def read_table(location: StorageLocation, run: str, version: int, rollout_id: int, batch_checksum: str) -> pa.Table:
    """The side table of (run, version, rollout_id), checked against itself and the stored batch."""
    key = table_key(run, version, rollout_id)
    table = pq.read_table(io.BytesIO(location.get(key)))
    meta = table.schema.metadata or {}
    if meta.get(b"checksum", b"").decode() != table_checksum(table):
        raise RescoreError(f"side table {key} is corrupt: its checksum does not match its content")
    if meta.get(b"batch_checksum", b"").decode() != batch_checksum:
        raise RescoreError(
            f"side table {key} was scored from another batch {run}/{rollout_id} (replaced since); rescore it again"
        )
    return table


def apply_rescored(batch: dict[str, list], table: pa.Table) -> dict[str, list]:
    """The batch with the side table's REPLACED columns (module docstring); rows must match by
    (group_index, index), in the batch's order."""
    keys = list(zip(table.column("group_index").to_pylist(), table.column("index").to_pylist()))
    if keys != list(zip(batch["group_index"], batch["index"])):
        raise RescoreError("the side table's samples are not the batch's (group_index, index), in order")
    return {**batch, **{name: table.column(name).to_pylist() for name in REPLACED}}
