"""Rollout batches as Arrow tables in object storage, with lineage and an index:
`BatchStore("runs")` (or "s3://bucket/prefix") writes, reads verified and indexes them.
docs/lineage.md describes the layout, the schema, the queries and retention."""

from vime_core.storage.schema import (
    BATCH_SCHEMA,
    LINEAGE_KEYS,
    SCHEMA_VERSION,
    SchemaError,
    SchemaVersionError,
    batch_to_table,
    table_to_batch,
)
from vime_core.storage.store import (
    BatchExistsError,
    BatchNotFoundError,
    BatchRef,
    BatchStore,
    CorruptBatchError,
)

__all__ = [
    "BATCH_SCHEMA",
    "LINEAGE_KEYS",
    "SCHEMA_VERSION",
    "BatchExistsError",
    "BatchNotFoundError",
    "BatchRef",
    "BatchStore",
    "CorruptBatchError",
    "SchemaError",
    "SchemaVersionError",
    "batch_to_table",
    "table_to_batch",
]
