"""rollout-k: generate (or load the stored) batch of rollout k, and persist it with its lineage."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from prefect import Task, get_run_logger, task

from tasks.common import TASK_DEFAULTS, first_try, run_handles
from vime_core.cluster import batch_io
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase
from vime_core.storage import BatchStore
from vime_core.storage.schema import DATA_SOURCE_AFTER
from vime_core.utils.timing import Stopwatch


@dataclass
class RolloutOutput:
    batch_ref: Any  # ray.ObjectRef of the batch dict; the driver never holds the batch
    metrics: dict = field(default_factory=dict)
    from_store: bool = False
    storage_key: str = ""
    next_stored: bool = False  # rollout k+1's batch is already stored (a resumed run): not prefetched
    replaces_quarantined: bool = False  # the stored batch could not be trained on: persist overwrites it


@task(name=Phase.ROLLOUT, task_run_name="rollout-{rollout_id}", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def rollout(config: VimeConfig, rollout_id: int, version: int | None = None) -> RolloutOutput:
    """The rollout phase (generate, then build the batch), with the engines at weights `version`. Idempotent: a batch
    already stored for this rollout id is loaded (checksum verified) instead of regenerated, unless
    the trainer could not train on it (it is then quarantined and generated again); a
    rollout the previous iteration started for this id and version (sync or start_next_rollout) is
    claimed instead of started."""
    import ray

    log = get_run_logger()
    manager, _ = run_handles(config)
    since = Stopwatch()  # t_rollout: to whichever return ends the phase
    usable, quarantined = batch_io.usable_stored(config, rollout_id)
    if quarantined is not None:
        log.warning(
            "rollout %d: the stored batch cannot be trained on (%s); quarantined at %s, generating rollout %d again",
            rollout_id,
            quarantined["reason"],
            quarantined["quarantined_key"],
            rollout_id,
        )
    if usable:
        ref, key = batch_io.load(config, rollout_id)
        log.info("rollout %d: loaded stored batch %s", rollout_id, key)
        metrics = batch_io.summarize(ref)
        metrics["t_rollout"] = since.seconds
        return RolloutOutput(
            ref, metrics, from_store=True, storage_key=key, next_stored=batch_io.stored(config, rollout_id + 1)
        )
    batch_ref, metrics_ref = manager.generate.options(num_returns=2).remote(rollout_id, version)
    next_stored = batch_io.stored(config, rollout_id + 1)  # looked up while the rollout runs
    metrics = dict(ray.get(metrics_ref))
    metrics.setdefault("t_rollout", since.seconds)
    return RolloutOutput(batch_ref, metrics, next_stored=next_stored, replaces_quarantined=quarantined is not None)


@task(name=Phase.START_NEXT_ROLLOUT, task_run_name="start-rollout-{rollout_id}", **TASK_DEFAULTS)
def start_next_rollout(config: VimeConfig, rollout_id: int, version: int) -> bool:
    """Start rollout `rollout_id` on the engines now that they hold weights `version`, so it runs
    while this flow run ends and the next one starts (the iteration flow calls it when
    config.rollout_prefetch and an evaluation ran after sync; otherwise sync starts it), once
    the rollout task has found its batch not stored (`RolloutOutput.next_stored`). True when
    started."""
    import ray

    manager, _ = run_handles(config)
    return bool(ray.get(manager.start_generate.remote(rollout_id, version)))


# An object store that does not answer (server down or restarting) fails a try after botocore's
# own retries (storage_request_retries); the tries after it wait longer each time
# (persist_retry_delays_s), so a short outage is ridden out. The decorator's are the defaults;
# a run's come from its configuration (persist_for).
_DEFAULT_DELAYS_S = VimeConfig.model_fields["persist_retry_delays_s"].get_default(call_default_factory=True)


@task(
    name=Phase.PERSIST,
    task_run_name="persist-{rollout_id}",
    retries=len(_DEFAULT_DELAYS_S),
    retry_delay_seconds=_DEFAULT_DELAYS_S,
    **TASK_DEFAULTS,
)
def persist(config: VimeConfig, rollout_id: int, out: RolloutOutput, flow_run_id: str) -> dict:
    """The persist phase: the batch as an Arrow table with its lineage, written atomically
    (a try cut short leaves nothing visible). A retry that finds the batch published keeps it:
    the try before stored it and lost the answer."""
    if out.from_store:
        return {"key": out.storage_key, "t_persist": 0.0, "skipped": True}
    since = Stopwatch()  # t_persist: to whichever return ends the phase
    if not first_try() and not out.replaces_quarantined and batch_io.stored(config, rollout_id):
        key = BatchStore.for_config(config).ref(config.run_name, rollout_id).key
        get_run_logger().info("rollout %d: stored by an earlier try at %s", rollout_id, key)
        return {"key": key, "t_persist": since.seconds, "stored_by_earlier_try": True}
    info = batch_io.save(
        config,
        rollout_id,
        out.batch_ref,
        flow_run_id,
        overwrite=out.replaces_quarantined,
        data_source_state=out.metrics.get(DATA_SOURCE_AFTER),
    )
    info["t_persist"] = since.seconds
    get_run_logger().info("rollout %d: stored %s", rollout_id, info.get("key"))
    return info


def persist_for(config: VimeConfig) -> Task:
    """The persist task with the configuration's retries, one per config.persist_retry_delays_s,
    waiting that long before each: Prefect reads a task's retries from the task object, not from
    its arguments."""
    return _persist_retrying(tuple(config.persist_retry_delays_s))


@functools.cache
def _persist_retrying(delays_s: tuple[float, ...]) -> Task:
    return persist.with_options(retries=len(delays_s), retry_delay_seconds=list(delays_s))
