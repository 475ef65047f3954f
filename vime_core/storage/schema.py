"""The Arrow schema of a stored rollout batch, its lineage metadata, and the checksum. A batch is one
Arrow table, one row per sample, the columns of `BATCH_SCHEMA` and the lineage as schema metadata
(one key per lineage field, JSON-encoded).

    checksum = sha256( IPC_stream( canonical(table) ) ).hexdigest()

canonical(table): every column in one chunk, schema metadata reduced to the keys other than
`checksum`, sorted; IPC_stream: `pyarrow.ipc.new_stream` with default options. It covers every
value, type and lineage field but not the Parquet encoding. It is part of the stored format:
changing it needs a SCHEMA_VERSION bump (tests/unit/data/rollout_batch_v1.parquet must keep verifying)."""

from __future__ import annotations

import datetime as dt
import enum
import functools
import hashlib
import json
import numbers
import subprocess
from dataclasses import asdict, is_dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.compute as pc

from vime_core.data.columns import BATCH_COLUMNS
from vime_core.data.validation import UntrainableBatchError, validate_trainable
from vime_core.utils.secrets import redact_secrets

SCHEMA_VERSION = 2
"""Bump when a column is added, removed or changes meaning; add an upgrade to `UPGRADES`."""

# One field per column of vime_core.data.columns, its meaning as the field's description.
BATCH_SCHEMA = pa.schema(
    [pa.field(c.name, c.type, nullable=c.nullable, metadata={"description": c.meaning}) for c in BATCH_COLUMNS],
    metadata={"schema_version": json.dumps(SCHEMA_VERSION)},
)
COLUMNS: tuple[str, ...] = tuple(BATCH_SCHEMA.names)

# The lineage key (and the rollout metrics' key) of the data source's position after a rollout.
DATA_SOURCE_AFTER = "data_source_after"

LINEAGE_DESCRIPTIONS: dict[str, str] = {
    "run": "run name (required)",
    "rollout_id": "rollout iteration id (required, int >= 0)",
    "schema_version": "version of BATCH_SCHEMA the table was written with (set by the store)",
    "config_hash": "vime_core.config.config_hash of the resolved configuration",
    "config": "the full resolved configuration, a JSON string (credential-like values redacted)",
    "code_version": "`git describe --always --dirty --tags` of the code that wrote it (computed)",
    "model_id": "model / checkpoint the rollout started from",
    "dataset_id": "prompt dataset",
    "prompt_ids": "prompt id of every group, in group order (computed from the batch if absent)",
    "weight_versions": "sorted distinct weight versions that generated the batch (computed)",
    "flow_run_id": "Prefect flow run that produced the batch",
    DATA_SOURCE_AFTER: "the prompt data source's position after this rollout (a JSON object; a run resumed past its "
    "checkpoint continues from it)",
    "created_at": "ISO-8601 UTC time of writing (computed if absent)",
    "num_rows": "number of samples (computed)",
    "checksum": "sha256 of the canonical IPC bytes, see module docstring (computed)",
}
LINEAGE_KEYS: tuple[str, ...] = tuple(LINEAGE_DESCRIPTIONS)
_COMPUTED_KEYS = ("schema_version", "num_rows", "checksum")


class SchemaError(ValueError):
    """A batch or a stored table does not match the schema; the message names the column."""


class SchemaVersionError(SchemaError):
    """A stored table has a schema version this code cannot read."""


# ---- upgrades ---------------------------------------------------------------------------------
# UPGRADES[v] turns a table of schema version v into one of version v + 1 (lineage metadata
# included). Reading a table of version v < SCHEMA_VERSION applies UPGRADES[v], UPGRADES[v+1], ...
# A missing step refuses the read with a message naming both versions.
def _add_routed_experts(table: pa.Table) -> pa.Table:
    """1 -> 2: the `routed_experts` column, null (version 1 recorded no routing)."""
    field = BATCH_SCHEMA.field("routed_experts")
    upgraded = table.add_column(COLUMNS.index(field.name), field, pa.nulls(table.num_rows, field.type))
    meta = dict(table.schema.metadata or {})
    meta[b"schema_version"] = json.dumps(2).encode()
    return upgraded.replace_schema_metadata(meta)


UPGRADES: dict[int, Callable[[pa.Table], pa.Table]] = {1: _add_routed_experts}


def upgrade_table(table: pa.Table, source: str = "table") -> pa.Table:
    """Bring `table` to SCHEMA_VERSION through UPGRADES, or raise SchemaVersionError."""
    version = stored_schema_version(table, source)
    if version > SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{source} has schema version {version}, newer than this vime's {SCHEMA_VERSION}: read it with a newer vime"
        )
    while version < SCHEMA_VERSION:
        step = UPGRADES.get(version)
        if step is None:
            raise SchemaVersionError(
                f"{source} has schema version {version}; this vime reads version {SCHEMA_VERSION} "
                f"and has no upgrade from {version} to {version + 1} "
                f"(add one to vime_core.storage.schema.UPGRADES, or replay it with the vime that wrote it)"
            )
        table = step(table)
        new_version = stored_schema_version(table, source)
        if new_version != version + 1:
            raise SchemaVersionError(f"upgrade {version}->{version + 1} of {source} produced version {new_version}")
        version = new_version
    return table


def stored_schema_version(table: pa.Table, source: str = "table") -> int:
    raw = (table.schema.metadata or {}).get(b"schema_version")
    if raw is None:
        raise SchemaVersionError(f"{source} has no schema_version in its metadata: not a vime rollout batch")
    return int(json.loads(raw))


# ---- lineage ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """`git describe --always --dirty --tags` of this checkout; the package version without git."""
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        try:
            return f"vime-{version('vime')}"
        except PackageNotFoundError:
            return "unknown"


def _group_prompt_ids(prompt_ids: pa.Array, group_index: pa.Array) -> list[str]:
    """Prompt id of each group, in row order (a group = a run of equal group_index)."""
    if len(group_index) == 0:
        return []
    starts = pc.not_equal(group_index[1:], group_index[:-1])
    mask = pa.concat_arrays([pa.array([True]), starts])
    return pc.filter(prompt_ids, mask).to_pylist()


def _distinct_versions(spans: pa.Array) -> list[int]:
    versions = pc.struct_field(pc.list_flatten(spans), "version")
    return sorted(int(v) for v in pc.unique(versions).to_pylist())


def complete_lineage(lineage: dict, table: pa.Table) -> dict:
    """The full lineage of `table`: caller's keys, plus the computed ones (without checksum)."""
    unknown = sorted(set(lineage) - set(LINEAGE_KEYS))
    if unknown:
        raise SchemaError(f"unknown lineage keys {unknown}; known: {list(LINEAGE_KEYS)}")
    for key in ("run", "rollout_id"):
        if key not in lineage:
            raise SchemaError(f"lineage is missing required key {key!r}")
    rollout_id = lineage["rollout_id"]
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, numbers.Integral) or rollout_id < 0:
        raise SchemaError(f"lineage rollout_id must be an int >= 0, got {rollout_id!r}")
    rollout_id = int(rollout_id)
    if not isinstance(lineage["run"], str) or not lineage["run"]:
        raise SchemaError(f"lineage run must be a non-empty string, got {lineage['run']!r}")
    config = lineage.get("config", {})
    if isinstance(config, str):
        try:
            config = json.loads(config) if config else {}
        except json.JSONDecodeError as exc:
            raise SchemaError(f"lineage config is not valid JSON: {exc.msg} at char {exc.pos}") from None
    full: dict[str, Any] = {
        "run": lineage["run"],
        "rollout_id": rollout_id,
        "schema_version": SCHEMA_VERSION,
        "config_hash": str(lineage.get("config_hash", "")),
        "config": json.dumps(redact_secrets(config), sort_keys=True, separators=(",", ":")),
        "code_version": str(lineage.get("code_version") or code_version()),
        "model_id": str(lineage.get("model_id", "")),
        "dataset_id": str(lineage.get("dataset_id", "")),
        "prompt_ids": list(lineage["prompt_ids"])
        if "prompt_ids" in lineage
        else _group_prompt_ids(
            table.column("prompt_id").combine_chunks(), table.column("group_index").combine_chunks()
        ),
        "weight_versions": sorted(int(v) for v in lineage["weight_versions"])
        if "weight_versions" in lineage
        else _distinct_versions(table.column("weight_versions").combine_chunks()),
        "flow_run_id": str(lineage.get("flow_run_id", "")),
        DATA_SOURCE_AFTER: lineage.get(DATA_SOURCE_AFTER) or {},
        "created_at": str(lineage.get("created_at") or dt.datetime.now(dt.timezone.utc).isoformat()),
        "num_rows": table.num_rows,
    }
    return redact_secrets(full)


def _encode_metadata(lineage: dict) -> dict[bytes, bytes]:
    return {k.encode(): json.dumps(lineage[k], sort_keys=True).encode() for k in sorted(lineage)}


def lineage_of(table: pa.Table) -> dict:
    """The lineage stored in a table's schema metadata (values decoded)."""
    meta = table.schema.metadata or {}
    return {k.decode(): json.loads(v) for k, v in meta.items() if k.decode() in LINEAGE_DESCRIPTIONS}


def table_checksum(table: pa.Table) -> str:
    """sha256 hex of the canonical IPC bytes of `table` without its checksum (module docstring)."""
    metadata = {k: v for k, v in (table.schema.metadata or {}).items() if k != b"checksum"}
    # combine_chunks: one chunk per column, so chunking does not change the bytes; the IPC
    # writer itself rebases sliced offsets and bitmaps, so slices do not either.
    canonical = table.combine_chunks().replace_schema_metadata(dict(sorted(metadata.items())))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, canonical.schema) as writer:
        for record_batch in canonical.to_batches():
            if record_batch.num_rows:
                writer.write_batch(record_batch)
    return hashlib.sha256(sink.getvalue()).hexdigest()


# ---- batch <-> table --------------------------------------------------------------------------
def _normalise(name: str, values: list) -> list:
    if name == "status":
        return [v.value if isinstance(v, enum.Enum) else v for v in values]
    if name == "weight_versions":
        return [[asdict(s) if is_dataclass(s) else s for s in spans] for spans in values]
    if name == "metadata":
        return [json.dumps(v, sort_keys=True) if isinstance(v, dict) else v for v in values]
    return values


def batch_to_table(batch: dict[str, list], lineage: dict) -> pa.Table:
    """The stored form of a batch: BATCH_SCHEMA columns, full lineage and checksum in metadata.

    Raises SchemaError naming the column for a missing/unknown column, ragged lengths, a value
    of the wrong type, a null in a non-nullable column, or a row whose lengths disagree (the
    length rules of vime_core/data/validation.py).
    """
    missing = [c for c in COLUMNS if c not in batch]
    unknown = sorted(set(batch) - set(COLUMNS))
    if missing or unknown:
        raise SchemaError(
            f"batch columns do not match schema version {SCHEMA_VERSION}: missing {missing}, unknown {unknown}"
        )
    num_rows = len(batch[COLUMNS[0]])
    arrays = []
    for field in BATCH_SCHEMA:
        values = batch[field.name]
        if len(values) != num_rows:
            raise SchemaError(f"batch column {field.name!r} has {len(values)} rows, {COLUMNS[0]!r} has {num_rows}")
        try:
            array = pa.array(_normalise(field.name, list(values)), type=field.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError) as exc:
            raise SchemaError(f"batch column {field.name!r}: values do not fit {field.type}: {exc}") from None
        if not field.nullable and array.null_count:
            raise SchemaError(f"batch column {field.name!r} has {array.null_count} null values; it is not nullable")
        arrays.append(array)
    try:  # the rows' lengths agree (every stored batch keeps these; trainability is the trainer's)
        validate_trainable(batch, lengths_only=True)
    except UntrainableBatchError as exc:
        raise SchemaError(str(exc)) from None
    table = pa.Table.from_arrays(arrays, schema=BATCH_SCHEMA.remove_metadata())
    full = complete_lineage(lineage, table)
    table = table.replace_schema_metadata(_encode_metadata(full))
    full["checksum"] = table_checksum(table)
    return table.replace_schema_metadata(_encode_metadata(full))


def table_to_batch(table: pa.Table) -> tuple[dict[str, list], dict]:
    """(batch dict, lineage) of a stored table of the current schema version.

    `table_to_batch(batch_to_table(b, lineage))` gives back `b` exactly, but rollout_log_probs are
    float32, `status` enums their string value, weight_versions spans plain dicts and a dict metadata
    its JSON string (keys sorted)."""
    version = stored_schema_version(table)
    if version != SCHEMA_VERSION:
        raise SchemaVersionError(
            f"table has schema version {version}, expected {SCHEMA_VERSION}: upgrade_table() it first"
        )
    batch = {name: table.column(name).to_pylist() for name in COLUMNS}
    return batch, lineage_of(table)


def describe_schema() -> str:
    """Markdown tables of the batch columns and the lineage keys (docs/lineage.md is made from it)."""
    lines = [
        f"Schema version {SCHEMA_VERSION}.",
        "",
        "| column | Arrow type | nullable | meaning |",
        "|---|---|---|---|",
    ]
    for field in BATCH_SCHEMA:
        desc = (field.metadata or {}).get(b"description", b"").decode()
        lines.append(f"| {field.name} | `{field.type}` | {'yes' if field.nullable else 'no'} | {desc} |")
    lines += ["", "| lineage key (table metadata, JSON value) | meaning |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in LINEAGE_DESCRIPTIONS.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(describe_schema())
