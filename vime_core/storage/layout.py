"""Where things live inside a store (keys relative to its root):

    batches/<run>/<rollout_id:08d>-<checksum[:16]>.parquet         published batch objects
    index/manifests/<run>/<rollout_id:08d>-<checksum[:16]>.parquet one index row per batch
    index/manifests/<run>/<rollout_id:08d>-<checksum[:16]>.unpublished.parquet  its tombstone
    index/compacted/<utc time>-<random>.parquet                    many rows, made by compact()
    tmp/<run>/<rollout_id:08d>-<random>.parquet                    uploads not yet verified

Names carry the checksum, so a re-written batch never replaces an object a reader may be reading."""

from __future__ import annotations

import datetime as dt
import numbers
import re
import uuid

BATCHES = "batches"
MANIFESTS = "index/manifests"
COMPACTED = "index/compacted"
TMP = "tmp"
QUARANTINE = "quarantine"

RUN_CONFIG = "config.json"  # a run's resolved configuration, in its report folder (run_dir)

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def run_dir(storage_uri: str, run_name: str, kind: str = "reports") -> str:
    """Where a run's files of one kind live: `<storage>/<kind>/<run>`, beside the batch store's
    `batches/<run>` (kinds: reports, checkpoints, exports)."""
    return f"{storage_uri.rstrip('/')}/{kind}/{run_name}"


def check_run(run: str) -> str:
    """The run name, if it is a safe path segment (the same rule as VimeConfig.run_name)."""
    if not isinstance(run, str) or not RUN_NAME.match(run) or ".." in run:
        raise ValueError(f"run name {run!r} must match {RUN_NAME.pattern} (it becomes a folder name)")
    return run


def check_rollout_id(rollout_id: int) -> int:
    if isinstance(rollout_id, bool) or not isinstance(rollout_id, numbers.Integral) or rollout_id < 0:
        raise ValueError(f"rollout_id must be an int >= 0, got {rollout_id!r}")
    return int(rollout_id)


def _stem(rollout_id: int, checksum: str) -> str:
    return f"{check_rollout_id(rollout_id):08d}-{checksum[:16]}"


def batch_key(run: str, rollout_id: int, checksum: str) -> str:
    return f"{BATCHES}/{check_run(run)}/{_stem(rollout_id, checksum)}.parquet"


def manifest_key(run: str, rollout_id: int, checksum: str) -> str:
    return f"{MANIFESTS}/{check_run(run)}/{_stem(rollout_id, checksum)}.parquet"


def tombstone_key(run: str, rollout_id: int, checksum: str) -> str:
    """The manifest that removes a published batch from the index (index.py: tombstones)."""
    return f"{MANIFESTS}/{check_run(run)}/{_stem(rollout_id, checksum)}.unpublished.parquet"


def quarantine_key(run: str, rollout_id: int, checksum: str) -> str:
    """Where a stored batch the trainer cannot use is kept aside (with a `.json` record beside it)."""
    return f"{QUARANTINE}/{check_run(run)}/{_stem(rollout_id, checksum)}.parquet"


def manifest_prefix(run: str, rollout_id: int) -> str:
    """The name start shared by every manifest of (run, rollout_id)."""
    return f"{MANIFESTS}/{check_run(run)}/{check_rollout_id(rollout_id):08d}-"


def tmp_key(run: str, rollout_id: int) -> str:
    return f"{TMP}/{check_run(run)}/{check_rollout_id(rollout_id):08d}-{uuid.uuid4().hex}.parquet"


def compacted_key() -> str:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{COMPACTED}/{stamp}-{uuid.uuid4().hex[:12]}.parquet"
