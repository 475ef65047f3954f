"""Lineage questions answered from the index alone (index.INDEX_SCHEMA), never by reading batches: each
function takes the index table or a BatchStore and returns a pyarrow.Table. The same queries work on
the Parquet files without vime (`pyarrow.dataset.dataset("runs/index")`; keep the last published_at
per (run, rollout_id) while a compaction may run). docs/lineage.md has examples."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

import pyarrow as pa
import pyarrow.compute as pc

if TYPE_CHECKING:
    from vime_core.storage.store import BatchStore

IndexSource = Union[pa.Table, "BatchStore"]


def _of_run(source: IndexSource, run: str | None) -> pa.Table:
    index = source if isinstance(source, pa.Table) else source.index()
    return index if run is None else index.filter(pc.equal(index.column("run"), run))


def batches_by_weight_version(index: IndexSource, version: int, run: str | None = None) -> pa.Table:
    """Index rows of the batches that some weights `version` generated tokens of."""
    index = _of_run(index, run)
    versions = index.column("weight_versions").combine_chunks()
    # Flatten the per-batch version lists; parent indices map each version back to its row.
    hits = pc.equal(pc.list_flatten(versions), version)
    # Parent indices come out in row order, so the unique ones keep the index's order.
    rows = pc.unique(pc.filter(pc.list_parent_indices(versions), hits))
    return index.take(rows)


def prompt_use_counts(index: IndexSource, run: str | None = None, min_count: int = 2) -> pa.Table:
    """Prompts used by at least `min_count` groups: columns prompt_id, count, rollout_ids.

    A "use" is one group (a prompt copied n_samples_per_prompt times); the index stores the
    prompt id of every group, so a prompt sampled twice in one rollout counts twice.
    Sorted by count (descending), then prompt_id.
    """
    index = _of_run(index, run)
    prompts = index.column("prompt_ids").combine_chunks()
    parents = pc.list_parent_indices(prompts)
    uses = pa.table(
        {
            "prompt_id": pc.list_flatten(prompts),
            "rollout_id": pc.take(index.column("rollout_id"), parents),
        }
    )
    counts = uses.group_by("prompt_id").aggregate([("rollout_id", "count"), ("rollout_id", "distinct")])
    counts = counts.rename_columns(["prompt_id", "count", "rollout_ids"])
    counts = counts.filter(pc.greater_equal(counts.column("count"), min_count))
    ids = pa.array([sorted(v) for v in counts.column("rollout_ids").to_pylist()], pa.list_(pa.int64()))
    counts = counts.set_column(2, "rollout_ids", ids)
    return counts.sort_by([("count", "descending"), ("prompt_id", "ascending")])


def prompts_seen_twice(index: IndexSource, run: str | None = None) -> pa.Table:
    """Prompts used by two or more groups (prompt_use_counts with min_count=2)."""
    return prompt_use_counts(index, run=run, min_count=2)


def reward_by_iteration(index: IndexSource, run: str | None = None) -> pa.Table:
    """Per (run, rollout id): reward_mean (raw reward), response_length_mean, num_rows and the
    weight versions that generated it; sorted by run, then rollout_id."""
    rows = _of_run(index, run).select(
        [
            "run",
            "rollout_id",
            "reward_mean",
            "response_length_mean",
            "num_rows",
            "weight_version_min",
            "weight_version_max",
            "created_at",
        ]
    )
    return rows.sort_by([("run", "ascending"), ("rollout_id", "ascending")])


def batches_of_config(index: IndexSource, config_hash: str) -> pa.Table:
    """Index rows of the batches made under the configuration with this config_hash."""
    index = _of_run(index, None)
    return index.filter(pc.equal(index.column("config_hash"), config_hash))
