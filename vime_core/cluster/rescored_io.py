"""Stored batches with the rewards of a re-scoring (`vime rescore`, vime_core/storage/rescored.py),
read next to the data as a Ray task, as batch_io reads stored batches: the driver only sees the
object reference."""

from __future__ import annotations

from functools import lru_cache

from vime_core.config import VimeConfig
from vime_core.storage.endpoint import S3Endpoint


@lru_cache(maxsize=None)
def _read_remote():
    import ray

    @ray.remote(num_cpus=0)
    def read(uri: str, endpoint, run: str, rollout_id: int, version: int) -> dict:
        from vime_core.storage import BatchStore, rescored

        store = BatchStore(uri, endpoint=endpoint)
        batch, lineage = store.read(run, rollout_id)
        table = rescored.read_table(store.location, run, version, rollout_id, lineage["checksum"])
        return rescored.apply_rescored(batch, table)

    return read


def rescored_version(cfg: VimeConfig, rollout_id: int, which: str) -> int | None:
    """The re-scoring whose rewards batch `rollout_id` of run cfg.run_name trains on (None: its own)."""
    from vime_core.storage import BatchStore, rescored

    return rescored.resolve_version(BatchStore.for_config(cfg).location, cfg.run_name, rollout_id, which)


def load_rescored(cfg: VimeConfig, rollout_id: int, version: int):
    """Object ref of the stored batch of run cfg.run_name with re-scoring `version`'s rewards."""
    return _read_remote().remote(cfg.storage_uri, S3Endpoint.of(cfg), cfg.run_name, rollout_id, version)
