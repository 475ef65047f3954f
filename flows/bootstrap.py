"""The bootstrap job on its own: bring up a run's engines, router and
trainer group, restore its latest checkpoint, publish the weights. Idempotent."""

from __future__ import annotations

from prefect import flow

from tasks.bootstrap import bootstrap as bootstrap_task
from tasks.bootstrap import prepare_assets
from vime_core.config import VimeConfig


@flow(name="bootstrap", flow_run_name="bootstrap-{config.run_name}", log_prints=True)
def bootstrap(config: VimeConfig) -> dict:
    return bootstrap_task(prepare_assets(config))
