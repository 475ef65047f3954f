"""Where a run's actors go: one placement group, one bundle per device (`{"GPU": 1}`; on CPU machines
the Ray head declares device slots, so the same plan runs there). Colocated, trainer ranks and
engines share bundles 0..T-1; disaggregated, engines take bundles T..T+R-1. Each engine is one Ray
actor in the first bundle of its range with a fraction of a device, as slime does."""

from __future__ import annotations

from dataclasses import dataclass

from vime_core.config.derive import check_layout  # the fields' rule, checked when a configuration is made

TRAINER_SHARE_COLOCATED = 0.5
ENGINE_SHARE = 0.2
PROBE_SHARE = 0.01
# of a custom node resource (trainer_node_resource / engine_node_resource) per bundle: a node
# declaring 1 of it holds up to 1000 bundles
NODE_RESOURCE_SHARE = 0.001


@dataclass(frozen=True)
class PlacementPlan:
    num_bundles: int
    trainer_bundles: list[int]  # rank i -> bundle
    engine_bundles: list[list[int]]  # engine e -> its bundles, TP rank order
    trainer_share: float
    engine_share: float = ENGINE_SHARE


def plan_placement(
    trainer_devices: int, rollout_devices: int, devices_per_engine: int, colocate: bool
) -> PlacementPlan:
    """T = actor_num_nodes * actor_num_gpus_per_node trainer devices, R = rollout_num_gpus, G =
    rollout_num_gpus_per_engine, E = R // G engines. Colocated: bundles 0..T-1, trainer rank i in bundle
    i, engine e on bundles e*G .. e*G+G-1. Disaggregated: bundles 0..T+R-1, engine e on T+e*G .. T+e*G+G-1.
    An engine's vLLM server gets CUDA_VISIBLE_DEVICES of all its bundles, so its G TP workers land on
    distinct GPUs."""
    check_layout(trainer_devices, rollout_devices, devices_per_engine, colocate)
    engines = rollout_devices // devices_per_engine
    if colocate:
        first = 0
        total = trainer_devices
    else:
        first = trainer_devices
        total = trainer_devices + rollout_devices
    return PlacementPlan(
        num_bundles=total,
        trainer_bundles=list(range(trainer_devices)),
        engine_bundles=[
            list(range(first + e * devices_per_engine, first + (e + 1) * devices_per_engine)) for e in range(engines)
        ],
        trainer_share=TRAINER_SHARE_COLOCATED if colocate else 1.0,
    )


def bundle_resources(
    plan: PlacementPlan, trainer_resource: str | None = None, engine_resource: str | None = None
) -> list[dict[str, float]]:
    """The resources of each bundle of `plan`: one device, plus a share of the custom node
    resource of whoever uses the bundle (trainer ranks, engines, or both when colocated).

    With `trainer_node_resource` / `engine_node_resource` set, a bundle also asks a share
    (NODE_RESOURCE_SHARE) of that custom resource, so Ray puts it only on nodes declaring it (a
    colocated bundle asks for both); unset, `{"GPU": 1}` fits any node."""
    wanted: list[dict[str, float]] = [{"GPU": 1} for _ in range(plan.num_bundles)]
    users = [(trainer_resource, plan.trainer_bundles), (engine_resource, [b for e in plan.engine_bundles for b in e])]
    for resource, indices in users:
        if resource:
            for b in indices:
                wanted[b][resource] = NODE_RESOURCE_SHARE
    return wanted


@dataclass(frozen=True)
class BundleDevice:
    """What Ray assigned to one bundle: the node it is on and the device id there."""

    node_ip: str
    device_id: str


def one_engine_devices(engine: int, ids: list[int], devices: list[BundleDevice]) -> tuple[str, list[str]]:
    """(node ip, device ids for CUDA_VISIBLE_DEVICES) of engine `engine`, whose bundles `ids` Ray
    assigned `devices`: they must sit on one node (vLLM's TP workers of one server share a host) on
    distinct devices."""
    nodes = {d.node_ip for d in devices}
    device_ids = [d.device_id for d in devices]
    if len(nodes) != 1:
        raise RuntimeError(
            f"engine {engine}: its bundles {ids} are on several nodes {sorted(nodes)}; an engine's TP workers need "
            f"one node"
        )
    if len(set(device_ids)) != len(device_ids):
        raise RuntimeError(f"engine {engine}: its bundles {ids} share devices {device_ids}")
    return nodes.pop(), device_ids
