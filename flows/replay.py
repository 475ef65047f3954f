"""The replay job: stored batches (by run and rollout ids, or every batch of a weight version) -> a
trainer restored from a chosen checkpoint -> training, without engines. With the same checkpoint,
batches and configuration on the CPU default the weights come out bit-identical to the original run's.
`rewards`: the batches' own, or those a `vime rescore` stored beside them (vime_core/storage/rescored.py)."""

from __future__ import annotations

from prefect import flow, get_run_logger, task

from flows.settings import send_run_logs
from tasks.bootstrap import prepare_assets
from tasks.common import TASK_DEFAULTS
from vime_core.cluster.replay_trainers import (
    prepare_replay_trainers,
    save_replay,
    select_batches,
    train_on_stored_batch,
)
from vime_core.config import VimeConfig
from vime_core.utils.timing import Stopwatch


@task(name="replay-train", task_run_name="replay-train-{rollout_id}", **TASK_DEFAULTS)
def replay_one(config: VimeConfig, source_run: str, rollout_id: int, rewards: str = "stored") -> dict:
    return train_on_stored_batch(config, source_run, rollout_id, rewards)


@flow(name="replay", flow_run_name="replay-{source_run}", log_prints=True)
def replay(
    config: VimeConfig,
    source_run: str,
    checkpoint: str,
    rollout_ids: list[int] | None = None,
    weight_version: int | None = None,
    save: bool = True,
    rewards: str = "stored",
) -> dict:
    """Train `config.run_name`'s trainer on `source_run`'s stored batches, starting from `checkpoint`;
    `rewards`: the batches' own (stored), or those `vime rescore` stored (rescored, vN)."""
    send_run_logs()
    log = get_run_logger()
    replaying = Stopwatch()
    config = prepare_assets(config)
    ids = select_batches(config, source_run, rollout_ids, weight_version)
    log.info("replaying %s batches %s on checkpoint %s (rewards: %s)", source_run, ids, checkpoint, rewards)
    prepare_replay_trainers(config, checkpoint)
    metrics = {k: replay_one(config, source_run, k, rewards) for k in ids}
    out = {"rollout_ids": ids, "metrics": metrics, "seconds": replaying.seconds}
    if save and ids:
        out["checkpoint"] = save_replay(config, ids[-1])
    return out
