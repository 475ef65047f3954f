"""A run's long-lived actors: the device placement group, the engine actors, the RolloutManager and the
trainer group, all detached and named under the run's namespace, so bootstrap is idempotent (it
attaches to what exists and creates what is missing). The engine actors and the RolloutManager are
created with the run's engine token (cluster/engine_token.py)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Iterable, Optional

from vime_core.cluster import names
from vime_core.cluster.connect import actor_env, ensure_ray
from vime_core.cluster.engine_token import manager_engine_token, run_engine_token
from vime_core.cluster.errors import ActorsMissingError
from vime_core.cluster.placement import (
    PROBE_SHARE,
    BundleDevice,
    PlacementPlan,
    bundle_resources,
    one_engine_devices,
    plan_placement,
)
from vime_core.cluster.trainer_group import TrainerActor, TrainerGroup
from vime_core.config import VimeConfig
from vime_core.config.derive import trainer_num_devices
from vime_core.engines.auth import EngineToken
from vime_core.engines.server import EngineServer
from vime_core.rollout.manager import RolloutManager
from vime_core.utils.processes import free_port, process_age_s
from vime_core.utils.timing import Stopwatch

log = logging.getLogger(__name__)

# How long a liveness ping may wait for an actor that is busy with another call.
PING_TIMEOUT_S = 10.0
PLACEMENT_TIMEOUT_S = 120.0  # how long bootstrap waits for the run's placement group


class PlacementError(ValueError):
    """The run's device bundles cannot be placed on the cluster (too few GPUs or device slots, or
    nodes without the custom resources asked for): a configuration error, so the run stops with
    one line instead of waiting again on a retry."""


def plan_for(cfg: VimeConfig) -> PlacementPlan:
    """The run's placement plan (cluster/placement.py) from its configuration."""
    return plan_placement(trainer_num_devices(cfg), cfg.rollout_num_gpus, cfg.rollout_num_gpus_per_engine, cfg.colocate)


def _get_actor(name: str, run_name: str):
    import ray

    try:
        return ray.get_actor(name, namespace=names.namespace(run_name))
    except ValueError:
        return None


def is_alive(actor) -> bool:
    """False when the actor's process is dead (a call fails with RayActorError). An actor busy
    with another call for longer than PING_TIMEOUT_S counts as alive: a dead one fails at once."""
    import ray
    from ray.exceptions import RayActorError

    ping = actor.__ray_ready__.remote()
    ready, _ = ray.wait([ping], timeout=PING_TIMEOUT_S)
    if not ready:
        return True
    try:
        ray.get(ping)
    except RayActorError:
        return False
    return True


@dataclass
class RunActors:
    """The run's actors as `start_actors` found or made them."""

    manager: Any
    trainers: TrainerGroup
    new_manager: bool  # the RolloutManager was created (its data source starts at the beginning)
    created: bool  # the trainer group was created: `init` holds its first call, every rank's
    init: Optional[list]
    seconds: float  # finding or creating them
    began_s: Optional[float] = None  # when start_actors began, seconds since the command


def start_actors(config: VimeConfig) -> RunActors:
    """Find the run's actors or create what is missing: the placement group, one actor per
    engine, the RolloutManager (its constructor starts the engines and the router) and the
    trainer group, whose `init` (the weights from hf_checkpoint) is submitted at once when the
    group is new. New engine actors and a new RolloutManager get the run's engine token: the one
    the existing actors hold, else a new one (vime_core/cluster/engine_token.py). Returns
    without waiting for the engines or `init`. Plain (no Prefect): bootstrap calls it, and
    `vime train` before its first flow run (vime_core/cluster/early_start.py)."""
    since, began = Stopwatch(), process_age_s()
    ensure_ray(config.ray_address)
    pg = get_or_create_placement_group(config)
    token = run_engine_token(config, len(plan_for(config).engine_bundles))  # through Ray, never a file
    engines = get_or_create_engines(config, pg, token)  # one actor per engine, in its device bundles
    new_manager = not rollout_manager_exists(config)
    manager = get_or_create_rollout_manager(config, engines, token)
    trainers, created = get_or_create_trainer_group(config, pg)
    init = trainers.call_async("init", config.hf_checkpoint) if created else None  # beside the engines' start
    return RunActors(manager, trainers, new_manager, created, init, since.seconds, began)


def rollout_manager_exists(cfg: VimeConfig) -> bool:
    return _get_actor(names.ROLLOUT_MANAGER, cfg.run_name) is not None


def get_or_create_placement_group(cfg: VimeConfig):
    import ray
    from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

    pg_name = names.placement_group(cfg.run_name)
    plan = plan_for(cfg)
    num_bundles = plan.num_bundles
    bundles = bundle_resources(plan, cfg.trainer_node_resource, cfg.engine_node_resource)
    try:
        pg = get_placement_group(pg_name)
    except ValueError:
        pg = placement_group(bundles, strategy="PACK", name=pg_name, lifetime="detached")
    ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        # never placed, it holds nothing; left pending (it is detached), the same command run
        # after the layout was fixed would find it by name and wait for the old bundles again
        remove_placement_group(pg)
        node_resources = [r for r in (cfg.trainer_node_resource, cfg.engine_node_resource) if r]
        raise PlacementError(
            f"placement group {pg_name} ({num_bundles} device bundles) could not be "
            f"placed in {PLACEMENT_TIMEOUT_S:.0f} s: does the cluster declare enough GPUs/device slots? "
            f"(`vime cluster up --num-gpus N`)"
            + (
                f"; do the nodes declare the custom resources {node_resources} (`ray start --resources`)?"
                if node_resources
                else ""
            )
        )
    return pg


def _in_bundle(pg, index: int):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def _here() -> BundleDevice:
    """The node and device of the calling task or actor (the device of its bundle)."""
    import ray

    ids = ray.get_gpu_ids()
    return BundleDevice(ray.util.get_node_ip_address(), str(ids[0]) if ids else "")


def bundle_devices(pg, bundles: Iterable[int]) -> list[BundleDevice]:
    """The node and device id Ray assigned to each of `bundles` (indices), one tiny task per
    bundle: a Ray worker process each (a GPU task's worker is not reused)."""
    import ray

    probe = ray.remote(num_cpus=0, num_gpus=PROBE_SHARE)(_here)
    return ray.get([probe.options(scheduling_strategy=_in_bundle(pg, b)).remote() for b in bundles])


@dataclass(frozen=True)
class EngineDevices:
    """The device ids of engine `engine`, found in its actor's own process (EngineServer calls it):
    its own bundle's device from Ray, the other bundles' (an engine over several devices) from one
    probe each. The driver that creates the actor waits for no probe, so the actor's process start
    is not queued behind the probes' own."""

    pg: Any
    engine: int
    bundles: tuple[int, ...]

    def __call__(self) -> list[str]:
        devices = [_here(), *bundle_devices(self.pg, self.bundles[1:])]
        node_ip, device_ids = one_engine_devices(self.engine, list(self.bundles), devices)
        log.info("engine %d: bundles %s on %s, devices %s", self.engine, list(self.bundles), node_ip, device_ids)
        return device_ids


def get_or_create_engines(cfg: VimeConfig, pg, token: Optional[EngineToken] = None) -> list[Any]:
    """The run's engine actors; with cfg.engine_prestart, each one created here launches its
    server at once (`prestart`: the RolloutManager's start waits for it and watches the
    engine). One found alive is left as it is. External servers (`engine_urls`) need none:
    returns []. New ones get `token` (None: the run's, `engine_token.run_engine_token`)."""
    import ray

    if cfg.engine_urls:
        return []
    plan = plan_for(cfg)
    found = [_get_actor(names.engine(e), cfg.run_name) for e in range(len(plan.engine_bundles))]
    if all(a is not None for a in found):
        return found
    if token is None:
        token = run_engine_token(cfg, len(plan.engine_bundles))
    actor_cls = ray.remote(EngineServer)
    actors = []
    for e, existing in enumerate(found):
        if existing is not None:
            actors.append(existing)
            continue
        actor = actor_cls.options(
            name=names.engine(e),
            namespace=names.namespace(cfg.run_name),
            lifetime="detached",
            num_cpus=0,
            num_gpus=plan.engine_share,
            max_concurrency=4,  # health checks and memory reads while a start or restart runs
            scheduling_strategy=_in_bundle(pg, plan.engine_bundles[e][0]),
            runtime_env={"env_vars": actor_env()},
        ).remote(cfg, e, device_ids=EngineDevices(pg, e, tuple(plan.engine_bundles[e])), token=token)
        # vLLM launches as soon as the actor exists, not once the RolloutManager is made and
        # calls start() (which then waits for this start): its imports and engine-core start
        # overlap the manager's own start
        if cfg.engine_prestart:
            actor.prestart.remote()
        actors.append(actor)
    return actors


def get_or_create_rollout_manager(
    cfg: VimeConfig, engines: Optional[list[Any]] = None, token: Optional[EngineToken] = None
):
    """The RolloutManager; `engines`: the engine actors it starts and watches (None: it starts
    engine processes itself, or attaches to cfg.engine_urls). A new one gets `token` (None: the
    run's, `engine_token.run_engine_token`), the token its engines were made with."""
    import ray

    existing = _get_actor(names.ROLLOUT_MANAGER, cfg.run_name)
    if existing is not None:
        return existing
    if token is None:
        token = run_engine_token(cfg, len(plan_for(cfg).engine_bundles))
    actor_cls = ray.remote(RolloutManager)
    restarted = functools.partial(publish_to_restarted_engine, cfg)
    return actor_cls.options(
        name=names.ROLLOUT_MANAGER,
        namespace=names.namespace(cfg.run_name),
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=8,
        runtime_env={"env_vars": actor_env()},
    ).remote(cfg, engine_actors=engines or None, on_engine_restarted=restarted, token=token)


def publish_to_restarted_engine(cfg: VimeConfig, index: int, url: str) -> None:
    """Give a restarted engine the trainer's current weights (at the current version) before it
    serves again. Runs inside the RolloutManager actor; every TP rank takes part in the gather."""
    _, trainers = attach(cfg)
    version = trainers.rank0("state")["weight_version"]
    log.info("engine %d restarted at %s: publishing v%d to it", index, url, version)
    trainers.call("publish", [url], version)


def _master_endpoint(pg) -> tuple[str, int]:
    """Address and a free port on the node of bundle 0, where rank 0 runs: picked in this process
    when it is on that node (the placement group's table says), else by a task there (a Ray worker
    process to start, seconds on a loaded or fresh host)."""
    import ray
    from ray.util import placement_group_table

    node_id = placement_group_table(pg)["bundles_to_node_id"].get(0)
    if node_id == ray.get_runtime_context().get_node_id():
        [address] = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id]  # Ray's name for it
        return address, free_port()

    @ray.remote(num_cpus=0)
    def node_and_free_port() -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    return ray.get(node_and_free_port.options(scheduling_strategy=_in_bundle(pg, 0)).remote())


def get_or_create_trainer_group(cfg: VimeConfig, pg) -> tuple[TrainerGroup, bool]:
    """Returns (group, created). A created group still needs `init`."""
    import ray

    world = trainer_num_devices(cfg)
    # a rank whose process died may still be found by name for a moment: ask it
    found = [
        a if a is not None and is_alive(a) else None
        for a in (_get_actor(names.trainer(r), cfg.run_name) for r in range(world))
    ]
    if all(a is not None for a in found):
        group = TrainerGroup(cfg, found)
        diverged = group.rank0("state").get("diverged_rollout_id")
        if diverged is None:
            return group, False
        log.warning(
            "the trainer group holds steps of rollout %d applied before its training failed (or the run guard "
            "rejected it): rebuilt from the last checkpoint, the stored batches since are trained again",
            diverged,
        )
    if any(a is not None for a in found):
        # A partial group cannot rejoin torch.distributed: rebuild it whole.
        for a in found:
            if a is not None:
                ray.kill(a)
    master_addr, master_port = _master_endpoint(pg)
    plan = plan_for(cfg)
    actor_cls = ray.remote(TrainerActor)  # MegatronTrainer, built in the actor (trainer_group.py)
    token_source = functools.partial(manager_engine_token, cfg)  # the publish asks the run's RolloutManager
    actors = []
    for rank in range(world):
        actors.append(
            actor_cls.options(
                name=names.trainer(rank),
                namespace=names.namespace(cfg.run_name),
                lifetime="detached",
                num_cpus=0,
                num_gpus=plan.trainer_share,
                max_concurrency=1,
                scheduling_strategy=_in_bundle(pg, plan.trainer_bundles[rank]),
                runtime_env={"env_vars": actor_env()},
            ).remote(cfg, rank, world, master_addr, master_port, engine_token=token_source)
        )
    return TrainerGroup(cfg, actors), True


class AttachedHandles:
    """Handles a driver looked up: (Ray job, run, trainer world size) -> (manager, trainers).

    Every phase task attaches, and looking the actors up by name is one GCS round trip per
    actor, several per iteration on the critical path. Owned by the driver's task layer
    (tasks/common.py); bootstrap and teardown forget a run's handles (they create and kill the
    actors), a retried task looks them up afresh."""

    def __init__(self) -> None:
        self._handles: dict[tuple, tuple] = {}

    def get(self, key: tuple) -> Optional[tuple]:
        return self._handles.get(key)

    def put(self, key: tuple, handles: tuple) -> None:
        self._handles[key] = handles

    def forget(self, run_name: str) -> None:
        for key in [k for k in self._handles if k[1] == run_name]:
            del self._handles[key]


def attach(cfg: VimeConfig, cache: Optional[AttachedHandles] = None, reuse: bool = True):
    """(rollout_manager, trainer_group) of a bootstrapped run, or raise naming what is missing.
    `cache`: the handles this process looked up before for the same Ray job and run, reused
    when `reuse`, and updated with what is looked up."""
    import ray

    world = trainer_num_devices(cfg)
    key = (ray.get_runtime_context().get_job_id(), cfg.run_name, world)
    if cache is not None and reuse and (hit := cache.get(key)) is not None:
        manager, trainers = hit
        return manager, TrainerGroup(cfg, trainers)
    manager = _get_actor(names.ROLLOUT_MANAGER, cfg.run_name)
    trainers = [_get_actor(names.trainer(r), cfg.run_name) for r in range(world)]
    missing = ([names.ROLLOUT_MANAGER] if manager is None else []) + [
        names.trainer(r) for r, a in enumerate(trainers) if a is None
    ]
    if missing:
        raise ActorsMissingError(
            f"run {cfg.run_name!r} has no {', '.join(missing)} in namespace {names.namespace(cfg.run_name)} "
            f"(not bootstrapped yet, or the actor's process died); bootstrap (re)creates them",
            tuple(missing),
        )
    if cache is not None:
        cache.put(key, (manager, trainers))
    return manager, TrainerGroup(cfg, trainers)


def teardown(run_name: str, num_trainers: int | None = None) -> list[str]:
    """Stop the run's engines, kill its actors and remove its placement group. Returns what was
    removed. Safe to call when nothing exists."""
    import ray
    from ray.util.placement_group import remove_placement_group

    removed = []
    manager = _get_actor(names.ROLLOUT_MANAGER, run_name)
    if manager is not None:
        try:
            ray.get(manager.shutdown.remote(), timeout=120)
        except Exception as exc:  # the engines die with the actor's processes anyway
            log.warning("rollout manager shutdown failed: %s", exc)
        ray.kill(manager)
        removed.append(names.ROLLOUT_MANAGER)
    index = 0
    while (engine := _get_actor(names.engine(index), run_name)) is not None:
        try:  # the manager shut its server down; an engine it never started has none
            ray.get(engine.shutdown.remote(), timeout=60)
        except Exception as exc:
            log.warning("engine %d shutdown failed: %s", index, exc)
        ray.kill(engine)
        removed.append(names.engine(index))
        index += 1
    rank = 0
    while num_trainers is None or rank < num_trainers:
        a = _get_actor(names.trainer(rank), run_name)
        if a is None:
            if num_trainers is None:
                break
        else:
            ray.kill(a)
            removed.append(names.trainer(rank))
        rank += 1
    # by the placement-group table, so a group created from any driver namespace goes too
    from ray.util import placement_group_table
    from ray.util.placement_group import PlacementGroup

    for pg_id, info in placement_group_table().items():
        if info.get("name") == names.placement_group(run_name) and info.get("state") != "REMOVED":
            remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
            removed.append(names.placement_group(run_name))
    return removed
