"""The teardown job: stop a run's engines and router, remove its actors and placement group.
Stored batches and checkpoints stay."""

from __future__ import annotations

from prefect import flow, get_run_logger

from tasks.common import ATTACHED
from vime_core.cluster.connect import ensure_ray
from vime_core.cluster.run_actors import teardown as remove_run


@flow(name="teardown", flow_run_name="teardown-{run_name}")
def teardown(run_name: str, ray_address: str = "auto") -> list[str]:
    ensure_ray(ray_address)
    ATTACHED.forget(run_name)  # this driver's handles of the run's actors, about to be killed
    removed = remove_run(run_name)
    get_run_logger().info("removed %s", removed or "nothing (run had no live actors)")
    return removed
