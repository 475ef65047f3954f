"""The replay trainers: a trainer group with no engines, restored from a checkpoint, fed stored
batches (the flow that drives them is flows/replay.py)."""

from __future__ import annotations

from vime_core.cluster import batch_io, rescored_io
from vime_core.cluster.connect import ensure_ray
from vime_core.cluster.run_actors import get_or_create_placement_group, get_or_create_trainer_group
from vime_core.config import VimeConfig
from vime_core.storage import BatchStore
from vime_core.storage.lineage import batches_by_weight_version


def check_replay_request(cfg: VimeConfig, source_run: str, rollout_ids: list[int] | None) -> None:
    """A replay writes under its own run name (checkpoints/<run_name>/, its trainer actors), never
    the source run's: with the same name its checkpoint would replace the source run's own, which
    that run resumes from. Each rollout id once: one named twice would be trained on twice."""
    if cfg.run_name == source_run:
        raise ValueError(
            f"--run-name {cfg.run_name!r} is the --source-run: a replay needs a run name of its own "
            f"(e.g. --run-name {source_run}-replay); its checkpoints would replace the source run's"
        )
    repeated = sorted({k for k in rollout_ids or [] if rollout_ids.count(k) > 1})
    if repeated:
        raise ValueError(f"--rollout-ids names {repeated} more than once: each stored batch is replayed once")


def select_batches(
    cfg: VimeConfig, source_run: str, rollout_ids: list[int] | None, weight_version: int | None
) -> list[int]:
    """Rollout ids to replay: the given ones (each must be stored), or those a lineage query
    over the index selects."""
    check_replay_request(cfg, source_run, rollout_ids)
    store = BatchStore.for_config(cfg)
    if rollout_ids is None and weight_version is None:
        raise ValueError("replay needs rollout_ids or weight_version (a lineage query)")
    if rollout_ids is None:
        table = batches_by_weight_version(store, weight_version, run=source_run)
        return sorted(int(k) for k in table.column("rollout_id").to_pylist())  # published, by the index
    missing = [k for k in rollout_ids if not store.exists(source_run, k)]
    if missing:
        raise ValueError(f"run {source_run!r} has no stored batch for rollout ids {missing} in {cfg.storage_uri}")
    return sorted(rollout_ids)


def prepare_replay_trainers(cfg: VimeConfig, checkpoint: str):
    ensure_ray(cfg.ray_address)
    pg = get_or_create_placement_group(cfg)
    trainers, created = get_or_create_trainer_group(cfg, pg)
    if created:
        trainers.call("init", cfg.hf_checkpoint)
    trainers.call("load", checkpoint)
    return trainers


def _trainers(cfg: VimeConfig):
    ensure_ray(cfg.ray_address)
    trainers, created = get_or_create_trainer_group(cfg, get_or_create_placement_group(cfg))
    if created:
        raise RuntimeError(f"replay trainers of run {cfg.run_name!r} vanished; restart the replay")
    return trainers


def train_on_stored_batch(cfg: VimeConfig, source_run: str, rollout_id: int, rewards: str = "stored") -> dict:
    """Train on the stored batch, with its own rewards or a re-scoring's (`rewards`: stored,
    rescored, vN; vime_core/storage/rescored.py); the metrics say which (`rewards`)."""
    trainers = _trainers(cfg)
    source = cfg.model_copy(update={"run_name": source_run})
    version = rescored_io.rescored_version(source, rollout_id, rewards)
    ref = rescored_io.load_rescored(source, rollout_id, version) if version else batch_io.load(source, rollout_id)[0]
    metrics = trainers.call("train", rollout_id, ref)[0]
    return {**metrics, "rewards": f"v{version}" if version else "stored"}


def save_replay(cfg: VimeConfig, rollout_id: int) -> str:
    return _trainers(cfg).call("save", rollout_id, {"rollout_id": rollout_id, "replay": True})[0]
