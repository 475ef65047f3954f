"""`vime lineage --ledger`: a run's compute ledger per rollout id, one table from two sources:

    stored_*   counted from the run's stored batches (the index names them; only the columns
               response_length, status and loss_mask are read), with pyarrow compute:
               stored_samples, stored_response_tokens = sum(response_length),
               stored_trainable_tokens = sum(loss_mask), stored_reward_failed_tokens =
               sum(response_length | status failed), stored_truncated_tokens = sum(loss_mask |
               status truncated)
    the rest   each iteration record's ledger (vime_core/ledger.py), flattened:
               tokens_generated, tokens_trained, tokens_discarded_<cause>, useful_share,
               device_s_<phase>, device_s_held, trained_tokens_per_device_s, ...

joined on rollout_id (a full join: a batch stored by an iteration that never recorded, or a record
of a batch since pruned, still shows). What the batches hold checks what the records say: a
freshly generated batch has stored_trainable_tokens = the rollout's trainable tokens = tokens_trained
+ tokens_discarded_skipped_steps.
"""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from vime_core.ledger import flat
from vime_core.report.records import read_records

STORED_COLUMNS = ("response_length", "status", "loss_mask")


def _sum_where(values: pa.Array, where: pa.Array | None = None) -> int:
    chosen = values if where is None else pc.filter(values, where)
    return int(pc.sum(pc.cast(chosen, pa.int64())).as_py() or 0)


def _batch_counts(table: pa.Table) -> dict[str, int]:
    """One stored batch's token counts (module docstring), by pyarrow compute over its columns."""
    status = table.column("status").combine_chunks()
    lengths = table.column("response_length").combine_chunks()
    masks = table.column("loss_mask").combine_chunks()
    # one entry per response token: its mask, and its sample's status
    mask_values = pc.list_flatten(masks)
    token_status = pc.take(status, pc.list_parent_indices(masks))
    return {
        "stored_samples": table.num_rows,
        "stored_response_tokens": _sum_where(lengths),
        "stored_trainable_tokens": _sum_where(mask_values),
        "stored_reward_failed_tokens": _sum_where(lengths, pc.equal(status, "failed")),
        "stored_truncated_tokens": _sum_where(mask_values, pc.equal(token_status, "truncated")),
    }


def stored_token_counts(store, run: str) -> pa.Table:
    """Per rollout id of `run`, the token counts of its stored batch (module docstring)."""
    index = store.index()
    index = index.filter(pc.equal(index.column("run"), run))
    ids = index.column("rollout_id").to_pylist()
    keys = index.column("key").to_pylist()
    blobs = store.location.get_many(keys)
    rows = [
        {"rollout_id": k, **_batch_counts(pq.read_table(io.BytesIO(blobs[key]), columns=list(STORED_COLUMNS)))}
        for k, key in zip(ids, keys)
    ]
    return pa.Table.from_pylist(rows, schema=_STORED_SCHEMA)


_STORED_SCHEMA = pa.schema(
    [("rollout_id", pa.int64())]
    + [
        (name, pa.int64())
        for name in (
            "stored_samples",
            "stored_response_tokens",
            "stored_trainable_tokens",
            "stored_reward_failed_tokens",
            "stored_truncated_tokens",
        )
    ]
)


def recorded_ledgers(storage_uri: str, run: str, endpoint=None) -> pa.Table:
    """Per rollout id of `run`, its iteration record's ledger, flattened (vime_core/ledger.flat)."""
    # records written before the ledger existed have none: their rows show the stored counts alone
    records = [r for r in read_records(storage_uri, run, endpoint) if r.get("ledger")]
    rows = [{"rollout_id": r["rollout_id"], **flat(r["ledger"])} for r in records]
    return pa.Table.from_pylist(rows) if rows else pa.table({"rollout_id": pa.array([], pa.int64())})


def ledger_table(store, run: str, endpoint=None) -> pa.Table:
    """The run's ledger per rollout id: stored counts joined with the records' ledgers (module
    docstring), sorted by rollout_id."""
    stored = stored_token_counts(store, run)
    recorded = recorded_ledgers(store.uri, run, endpoint)
    joined = stored.join(recorded, "rollout_id", join_type="full outer", coalesce_keys=True)
    return joined.sort_by("rollout_id")
