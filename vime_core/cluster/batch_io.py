"""Moving rollout batches between Ray's object store and the batch store without passing them
through the driver: writes and reads run as Ray tasks next to the data; the driver only sees
object references and small dicts."""

from __future__ import annotations

import json
import statistics
from functools import lru_cache

from vime_core.config import VimeConfig, config_hash
from vime_core.config.derive import rollout_logprob_readers
from vime_core.config.loader import config_dict
from vime_core.data.batch import weight_version_range
from vime_core.data.validation import UntrainableBatchError, validate_trainable
from vime_core.storage import BatchStore
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.schema import DATA_SOURCE_AFTER, lineage_of
from vime_core.storage.store import BatchNotFoundError, CorruptBatchError
from vime_core.utils.timing import timed


@lru_cache(maxsize=None)
def _remote_functions():
    import ray

    @ray.remote(num_cpus=0)
    def write(uri: str, endpoint, batch: dict, lineage: dict, overwrite: bool = False) -> dict:
        from dataclasses import asdict

        with timed() as writing:
            ref = BatchStore(uri, endpoint=endpoint).write(batch, lineage, overwrite=overwrite)
        return {**asdict(ref), "t_write_s": writing.seconds}

    @ray.remote(num_cpus=0)
    def read(uri: str, endpoint, run: str, rollout_id: int) -> dict:
        batch, _lineage = BatchStore(uri, endpoint=endpoint).read(run, rollout_id)
        return batch

    @ray.remote(num_cpus=0)
    def summarize(batch: dict) -> dict:
        return batch_summary(batch)

    return write, read, summarize


def summarize(batch_ref) -> dict:
    """Statistics of a batch held in Ray's object store, computed where it lives."""
    import ray

    return ray.get(_remote_functions()[2].remote(batch_ref))


def lineage_for(cfg: VimeConfig, rollout_id: int, flow_run_id: str = "", data_source_after: dict | None = None) -> dict:
    """The lineage the caller knows; the store adds prompt ids, weight versions, row count,
    checksum, code version and creation time from the batch itself."""
    return {
        "run": cfg.run_name,
        "rollout_id": rollout_id,
        "config_hash": config_hash(cfg),
        "config": json.dumps(config_dict(cfg), sort_keys=True),
        "model_id": cfg.hf_checkpoint,
        "dataset_id": cfg.prompt_data,
        "flow_run_id": flow_run_id,
        DATA_SOURCE_AFTER: data_source_after or {},
    }


def data_source_after(cfg: VimeConfig, after_rollout_id: int) -> tuple[int, dict] | None:
    """(rollout id, the data source's state after it) of the newest stored batch with an id >=
    `after_rollout_id` that recorded it, or None. A run resumed past its checkpoint loads the
    stored batches since then instead of generating them: its data source goes on from here."""
    store = BatchStore.for_config(cfg)
    for ref in sorted(store.list_batches(cfg.run_name), key=lambda r: r.rollout_id, reverse=True):
        if ref.rollout_id < after_rollout_id:
            return None
        state = lineage_of(store.read_table(cfg.run_name, ref.rollout_id)).get(DATA_SOURCE_AFTER)
        if state:
            return ref.rollout_id, state
    return None


def stored(cfg: VimeConfig, rollout_id: int) -> bool:
    return BatchStore.for_config(cfg).exists(cfg.run_name, rollout_id)


def save(
    cfg: VimeConfig,
    rollout_id: int,
    batch_ref,
    flow_run_id: str = "",
    overwrite: bool = False,
    data_source_state: dict | None = None,
) -> dict:
    """Store the batch; `overwrite` replaces a quarantined one (usable_stored)."""
    import ray

    write, _, _ = _remote_functions()
    lineage = lineage_for(cfg, rollout_id, flow_run_id, data_source_state)
    return ray.get(write.remote(cfg.storage_uri, S3Endpoint.of(cfg), batch_ref, lineage, overwrite))


def usable_stored(cfg: VimeConfig, rollout_id: int) -> tuple[bool, dict | None]:
    """(whether rollout_id's stored batch can be trained on, the quarantine record when it could
    not). A stored batch that fails its checksum or the trainer's check (batches stored before
    that check existed) is quarantined (BatchStore.quarantine): kept, recorded with the reason,
    and replaced when the rollout is generated again; so is one without the log-probs a flag of
    `cfg` reads (e.g. stored before use_tis was set), and one still indexed whose object is gone."""
    store = BatchStore.for_config(cfg)
    if not store.exists(cfg.run_name, rollout_id):
        return False, None
    try:
        batch, _ = store.read(cfg.run_name, rollout_id)
        validate_trainable(batch, log_prob_readers=rollout_logprob_readers(cfg))
    except (UntrainableBatchError, CorruptBatchError, BatchNotFoundError) as exc:
        return False, store.quarantine(cfg.run_name, rollout_id, f"{type(exc).__name__}: {exc}")
    return True, None


def load(cfg: VimeConfig, rollout_id: int):
    """(object ref of the stored batch, its key)."""
    _, read, _ = _remote_functions()
    return read.remote(cfg.storage_uri, S3Endpoint.of(cfg), cfg.run_name, rollout_id), f"{cfg.run_name}/{rollout_id}"


def batch_summary(batch: dict) -> dict:
    """Reward and length statistics of a batch dict (for a batch loaded instead of generated)."""
    rewards = [float(r) for r in batch.get("raw_reward", [])]
    lengths = [int(x) for x in batch.get("response_length", [])]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_len_mean": statistics.fmean(lengths) if lengths else None,
        "response_len_max": max(lengths) if lengths else None,
        "num_samples": len(rewards),
        **weight_version_range(batch),
    }
