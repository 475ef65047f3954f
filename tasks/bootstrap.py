"""bootstrap: the run's startup, idempotent: attaches to the run's actors or creates what is missing,
restores the latest checkpoint, wakes engines a stopped iteration left asleep, publishes the
trainer's weights where they differ, and wakes the KV cache. `vime train` starts the actors early
(`start_early`), while Prefect's temporary server starts; bootstrap then claims them."""

from __future__ import annotations

from typing import Optional, Sequence

import ray
from prefect import get_run_logger, task

from tasks.common import ATTACHED, TASK_DEFAULTS, retry_rebuilding_actors
from tasks.sync import submit_publish, wait_publish
from vime_core.cluster.batch_io import data_source_after
from vime_core.cluster.connect import ensure_ray
from vime_core.cluster.early_start import claim_early, early_marks
from vime_core.cluster.run_actors import start_actors
from vime_core.config import VimeConfig
from vime_core.run_assets import resolve_run_config
from vime_core.step_plan import engines_sleep, trainer_sleeps
from vime_core.utils.processes import process_age_s, process_started_epoch
from vime_core.utils.timing import Stopwatch


@task(name="prepare-assets", retries=1, **TASK_DEFAULTS)
def prepare_assets(config: VimeConfig) -> VimeConfig:
    """Absolute paths, plus the embedded tiny model and task data when none are configured."""
    return resolve_run_config(config)


# its next try creates what died (an engine that crashed at start takes its RolloutManager with it)
BOOTSTRAP_TASK = {**TASK_DEFAULTS, "retry_condition_fn": retry_rebuilding_actors}


@task(name="bootstrap", retries=1, retry_delay_seconds=10, **BOOTSTRAP_TASK)
def bootstrap(config: VimeConfig) -> dict:
    from vime_core.trainer.checkpoint import latest_checkpoint  # torch: the driver imports no trainer/ module

    log = get_run_logger()
    since = Stopwatch()  # the marks below: seconds since this task began
    started = process_age_s()
    ensure_ray(config.ray_address)
    ATTACHED.forget(config.run_name)  # actors may be created now: no handle from before is reused
    early = claim_early(config)
    actors = early or start_actors(config)
    manager, trainers, created, new_manager = actors.manager, actors.trainers, actors.created, actors.new_manager
    seconds: dict[str, float] = {"actors_created": since.seconds}
    if early is not None:
        seconds["started_early"] = actors.seconds  # start_early's own seconds, before this task
    extra: dict = {}
    # a group found alive may be one an earlier attempt created and stopped between its init and
    # its restore: it starts as a created one (init is idempotent, restore happens once per actor)
    starting = created or not trainers.rank0("state")["restored"]
    if starting:  # the engines start meanwhile: the RolloutManager's constructor starts them
        trainers.wait(actors.init if created else trainers.call_async("init", config.hf_checkpoint))
        seconds["trainer_init"] = since.seconds
        ckpt = latest_checkpoint(config)
        extra = trainers.call("restore", ckpt)[0] or {}
        if ckpt is not None:
            log.info("restored checkpoint %s (rollout %s)", ckpt, extra.get("rollout_id"))
    if new_manager or starting:
        _restore_data_source(config, manager, extra.get("data_source"), new_manager)
    # an engine whose server died, or that failed to wake, is restarted (and given the trainer's
    # weights) before its version is asked; one the health monitor is restarting is waited for
    ray.get(manager.engine_urls.remote())  # returns once the manager's constructor has started the engines
    seconds["engines_ready"] = since.seconds
    engine_starts = ray.get(manager.engine_startup_marks.remote()) if (new_manager or starting) else []
    manager_epochs = ray.get(manager.startup_epochs.remote()) if new_manager else {}
    if restarted := ray.get(manager.check_engines.remote()):
        log.warning("restarted %d engine(s) whose server had died or could not wake", restarted)
    if woken := ray.get(manager.wake_asleep_engines.remote()):
        log.warning(
            "%s asleep (an iteration stopped while engines slept): woke the weights; "
            "the trainer's weights are published to every engine again",
            ", ".join(woken),
        )
    state = trainers.rank0("state")
    target = max(1, state["weight_version"])
    synced_at_start(config, manager, trainers, target, bool(woken))
    seconds["synced"] = since.seconds
    if trainer_sleeps(config):
        seconds["trainer_asleep"] = since.seconds
    ray.get(manager.onload_kv.remote())  # the last startup step: the engines' KV caches
    seconds["kv_onloaded"] = since.seconds
    last = state.get("last_trained_rollout_id")
    out = {
        "weight_version": target,
        "next_rollout_id": (last + 1) if last is not None else 0,
        "t_bootstrap": since.seconds,
        "created_trainers": created,
        "started_trainers": starting,
        "bootstrap_marks_s": seconds,
        "startup_marks_s": startup_marks(early_marks(early), started, seconds, engine_starts, manager_epochs),
        # each launched engine's torch.compile cache: "hit", "miss", "load_failure", None (compiled nothing)
        "engine_compile_cache": [e.get("compile_cache") for e in engine_starts if e.get("launched_epoch") is not None],
    }
    log.info(
        "bootstrap done in %.1fs: engines at v%d, next rollout %d (seconds from its start: %s)",
        out["t_bootstrap"],
        target,
        out["next_rollout_id"],
        ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()),
    )
    return out


def startup_marks(
    early: dict[str, float],
    bootstrap_started: float,
    seconds: dict[str, float],
    engine_starts: Sequence[dict] = (),
    manager_epochs: Optional[dict[str, float]] = None,
    command_epoch: Optional[float] = None,
) -> dict[str, float]:
    """Startup's marks in seconds since the command, in the order they happened: the early
    start's (`early`, already in those seconds), bootstrap's start, bootstrap's marks (`seconds`,
    from its start) moved by it, the RolloutManager's steps (`manager_epochs`:
    RolloutManager.startup_epochs) as manager_<step>, and each engine's launch and vLLM
    milestones (`engine_starts`: EngineServer.startup_marks, from its launch epoch) as
    engine<i>_<milestone>."""
    moved = {k: bootstrap_started + v for k, v in seconds.items() if k != "started_early"}  # started_early is a length
    marks = {**early, "bootstrap_started": bootstrap_started, **moved}
    command_epoch = process_started_epoch() if command_epoch is None else command_epoch
    marks.update({f"manager_{k}": epoch - command_epoch for k, epoch in (manager_epochs or {}).items()})
    for i, engine in enumerate(engine_starts):
        if engine.get("launched_epoch") is None:
            continue  # attached: no launch of ours
        launched = engine["launched_epoch"] - command_epoch
        marks[f"engine{i}_launched"] = launched
        marks.update({f"engine{i}_{k}": launched + v for k, v in (engine.get("marks_s") or {}).items()})
    return dict(sorted(marks.items(), key=lambda kv: kv[1]))


def synced_at_start(config: VimeConfig, manager, trainers, target: int, engines_woken: bool) -> None:
    """The engines at the trainer's weights (version `target`) and, colocated and sleeping, the
    trainer asleep, in the order that fits one device: the optimizer state, gradients and main
    parameters leave it before the publish, and colocated engines whose sleep drops their weights
    let their KV cache go for it (RolloutManager.room_for_publish; bootstrap wakes it last), so the
    device holds what it holds at each iteration's publish; the trainer's weights leave after it
    (the publish reads them, then releases them; or here, if none was needed)."""
    sleeps = trainer_sleeps(config)  # the engines generate first: the trainer gives them its memory
    if sleeps:
        trainers.call("sleep", True)
    versions = ray.get(manager.weight_versions.remote())
    if publish_needed(target, versions, engines_woken):  # the first publish is v1
        if config.colocate and engines_sleep(config):
            ray.get(manager.room_for_publish.remote())
        wait_publish(manager, trainers, submit_publish(manager, trainers, target, force=True))
        ray.get(manager.end_sync.remote(True, None, target))  # admission open again, requests name v`target`
    if sleeps:
        trainers.call("sleep")


def publish_needed(target: int, engine_versions: list[int], engines_woken: bool) -> bool:
    """The trainer's weights (version `target`) go to the engines when any engine reports
    another version, or when engines were woken from a sleep: what they report is then the
    version of weights they dropped (level 2) or that an interrupted publish half overwrote."""
    return engines_woken or not engine_versions or any(v != target for v in engine_versions)


def _restore_data_source(config: VimeConfig, manager, checkpoint_state: dict | None, new_manager: bool) -> None:
    """The data source's position when the RolloutManager or the trainer was (re)created.

    A new RolloutManager starts at the dataset's beginning. The batches stored since the
    checkpoint are loaded from the store, not generated again, so it takes the position recorded
    with the newest stored batch (its lineage's data_source_after), and the checkpoint's only
    when no stored batch recorded one (batches written before it was recorded). A RolloutManager
    that lived on (only the trainer died) already stands after the last batch it generated:
    rewinding it would give rollouts to come the prompts of rollouts already made. A rollout it
    started ahead (prefetch) ran on weights the rebuilt trainer publishes again: it is dropped
    and its prompts go back to the data source."""
    if not new_manager:
        ray.get(manager.discard_prefetch.remote(True))
        return
    newest = data_source_after(config, 0)
    state = newest[1] if newest is not None else checkpoint_state
    if state is not None:
        ray.get(manager.load_data_source_state.remote(state))
        get_run_logger().info(
            "data source resumed after %s", f"stored rollout {newest[0]}" if newest else "the checkpoint"
        )
