"""Placement on a real Ray head with 8 device slots: the device ids each engine actor gives its
server, and which trainer ranks share them (4 trainer ranks TP=2 x DP=2, 2 engines of TP=2),
colocated and disaggregated. No vLLM is started: the engine actors are created, not started."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(300)]


@pytest.mark.parametrize("colocate", [True, False], ids=["colocated-4-slots", "disaggregated-8-slots"])
def test_engines_receive_the_devices_of_their_bundles(ray_head, tiny_model_dir, colocate):
    import ray

    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import (
        bundle_devices,
        get_or_create_engines,
        get_or_create_placement_group,
        plan_for,
        teardown,
    )
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values

    cfg = make_config(
        demo_values(
            {
                "run_name": f"placement-{'colo' if colocate else 'disagg'}",
                "ray_address": ray_head,
                "hf_checkpoint": str(tiny_model_dir),
                "colocate": colocate,
                "actor_num_gpus_per_node": 4,
                "tensor_model_parallel_size": 2,
                "rollout_num_gpus": 4,
                "rollout_num_gpus_per_engine": 2,
                "engine_prestart": False,  # the actors are created, their servers not launched
            }
        )
    )
    ensure_ray(cfg.ray_address)
    try:
        pg = get_or_create_placement_group(cfg)
        plan = plan_for(cfg)
        bundles = bundle_devices(pg, range(plan.num_bundles))
        assert len({b.device_id for b in bundles}) == plan.num_bundles  # one device per bundle
        engines = get_or_create_engines(cfg, pg)
        got = [ray.get(e.get_device_ids.remote()) for e in engines]
        trainer_devices = [bundles[b].device_id for b in plan.trainer_bundles]
        if colocate:
            # engine e shares the devices of trainer ranks 2e and 2e+1 (one TP group each)
            assert got == [trainer_devices[0:2], trainer_devices[2:4]]
        else:
            assert sorted(got[0] + got[1]) == sorted(b.device_id for b in bundles[4:])
            assert not set(got[0] + got[1]) & set(trainer_devices)
        assert get_or_create_engines(cfg, pg) == engines  # idempotent: the same named actors
    finally:
        removed = teardown(cfg.run_name, num_trainers=4)
    assert "engine-0" in removed and "engine-1" in removed


def test_a_layout_the_cluster_cannot_place_fails_as_a_configuration_error_and_leaves_nothing(
    ray_head, tiny_model_dir, monkeypatch
):
    """16 device bundles on the head's 8 slots: PlacementError (a configuration error, so neither
    bootstrap's retry nor the iteration's waits again), naming the setting to check, and no
    pending placement group left behind; the same run with a layout that fits is then placed."""
    from ray.util.placement_group import get_placement_group

    import vime_core.cluster.run_actors as run_actors
    from vime_core.cluster import names
    from vime_core.cluster.connect import ensure_ray
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values
    from vime_core.faults import CONFIGURATION, classify

    monkeypatch.setattr(run_actors, "PLACEMENT_TIMEOUT_S", 3.0)
    values = {
        "run_name": "placement-too-big",
        "ray_address": ray_head,
        "hf_checkpoint": str(tiny_model_dir),
        "colocate": False,
        "actor_num_gpus_per_node": 8,
        "rollout_num_gpus": 8,
        "rollout_num_gpus_per_engine": 1,
    }
    cfg = make_config(demo_values(values))
    ensure_ray(cfg.ray_address)
    assert run_actors.plan_for(cfg).num_bundles == 16
    try:
        with pytest.raises(run_actors.PlacementError) as err:
            run_actors.get_or_create_placement_group(cfg)
        assert "16 device bundles" in str(err.value) and "--num-gpus" in str(err.value)
        assert classify(err.value).kind == CONFIGURATION
        with pytest.raises(ValueError):
            get_placement_group(names.placement_group(cfg.run_name))  # removed, not left pending

        fixed = make_config(demo_values({**values, "actor_num_gpus_per_node": 4, "rollout_num_gpus": 4}))
        pg = run_actors.get_or_create_placement_group(fixed)
        assert run_actors.plan_for(fixed).num_bundles == 8 and len(pg.bundle_specs) == 8
    finally:
        run_actors.teardown(cfg.run_name, num_trainers=8)
