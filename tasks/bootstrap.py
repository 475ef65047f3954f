"""bootstrap: the run's startup (resources, engines, router, trainer actors, checkpoint, version 1,
KV wake). Idempotent: attaches to the run's actors when they exist, creates what is missing, restores the latest checkpoint of the run, wakes the weights of engines
a stopped iteration left asleep, publishes the trainer's weights to the engines when they differ
or were asleep, and wakes the KV cache."""

from __future__ import annotations

import time

import ray
from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS
from tasks.sync import publish
from vime_core.cluster.connect import ensure_ray
from vime_core.config import VimeConfig


@task(name="prepare-assets", retries=1, **TASK_DEFAULTS)
def prepare_assets(config: VimeConfig) -> VimeConfig:
    """Absolute paths, plus the embedded tiny model and task data when none are configured."""
    from vime_core.run_assets import resolve_run_config

    return resolve_run_config(config)


@task(name="bootstrap", retries=1, retry_delay_seconds=10, **TASK_DEFAULTS)
def bootstrap(config: VimeConfig) -> dict:
    from vime_core.step_protocol import trainer_sleeps
    from tasks.common import ATTACHED
    from vime_core.cluster.run_actors import (
        get_or_create_engines,
        get_or_create_placement_group,
        get_or_create_rollout_manager,
        get_or_create_trainer_group,
        rollout_manager_exists,
    )
    from vime_core.trainer.checkpoint import latest_checkpoint

    log = get_run_logger()
    t0 = time.perf_counter()
    ensure_ray(config.ray_address)
    ATTACHED.forget(config.run_name)  # actors may be created now: no handle from before is reused
    pg = get_or_create_placement_group(config)
    engines = get_or_create_engines(config, pg)  # one actor per engine, in its device bundles
    new_manager = not rollout_manager_exists(config)
    manager = get_or_create_rollout_manager(config, engines)  # starts engines + router (steps 2, 4-7)
    trainers, created = get_or_create_trainer_group(config, pg)  # step 3
    seconds: dict[str, float] = {"actors_created": time.perf_counter() - t0}
    extra: dict = {}
    if created:  # the engines start meanwhile: the RolloutManager's constructor starts them
        trainers.call("init", config.hf_checkpoint)
        seconds["trainer_init"] = time.perf_counter() - t0
        ckpt = latest_checkpoint(config)
        extra = (trainers.call("load", ckpt)[0] or {}) if ckpt is not None else {}
        if ckpt is not None:
            log.info("restored checkpoint %s (rollout %s)", ckpt, extra.get("rollout_id"))
    if new_manager or created:
        _restore_data_source(config, manager, extra.get("data_source"), new_manager)
    # an engine whose server died, or that failed to wake, is restarted (and given the trainer's
    # weights) before its version is asked; one the health monitor is restarting is waited for
    ray.get(manager.engine_urls.remote())  # returns once the manager's constructor has started the engines
    seconds["engines_ready"] = time.perf_counter() - t0
    if restarted := ray.get(manager.check_engines.remote()):
        log.warning("restarted %d engine(s) whose server had died or could not wake", restarted)
    if woken := ray.get(manager.wake_asleep_engines.remote()):
        log.warning("%s asleep (an iteration stopped while engines slept): woke the weights; "
                    "the trainer's weights are published to every engine again", ", ".join(woken))
    state = trainers.rank0("state")
    target = max(1, state["weight_version"])
    versions = ray.get(manager.weight_versions.remote())
    if publish_needed(target, versions, bool(woken)):  # step 8: first publish is v1
        trainers.wait(publish(manager, trainers, target, force=True))
        ray.get(manager.end_sync.remote(resume=True))  # admission open again
    seconds["published"] = time.perf_counter() - t0
    if trainer_sleeps(config):  # the engines generate first: the trainer gives them its memory
        trainers.call("sleep")
    ray.get(manager.onload_kv.remote())  # the last startup step: the engines' KV caches
    seconds["kv_onloaded"] = time.perf_counter() - t0
    last = state.get("last_trained_rollout_id")
    out = {
        "weight_version": target,
        "next_rollout_id": (last + 1) if last is not None else 0,
        "t_bootstrap": time.perf_counter() - t0,
        "created_trainers": created,
        "bootstrap_marks_s": seconds,
    }
    log.info("bootstrap done in %.1fs: engines at v%d, next rollout %d (seconds from its start: %s)", out["t_bootstrap"],
             target, out["next_rollout_id"], ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    return out


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
    from vime_core.cluster.batch_io import data_source_after

    newest = data_source_after(config, 0)
    state = newest[1] if newest is not None else checkpoint_state
    if state is not None:
        ray.get(manager.load_data_source_state.remote(state))
        get_run_logger().info("data source resumed after %s", f"stored rollout {newest[0]}" if newest else "the checkpoint")
