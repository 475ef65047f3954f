"""save-k: trainer checkpoint with the data source cursor, so a run resumes exactly."""

from __future__ import annotations

import ray
from prefect import get_run_logger, task

from tasks.common import TASK_DEFAULTS, run_handles
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase
from vime_core.storage import BatchStore
from vime_core.utils.timing import timed


@task(name=Phase.SAVE, task_run_name="save-{rollout_id}", retries=2, retry_delay_seconds=5, **TASK_DEFAULTS)
def save_checkpoint(config: VimeConfig, rollout_id: int, engines_rest: bool = False) -> dict:
    """`engines_rest` (engines and a sleeping trainer share the devices): the trainer wakes whole
    to read the state it saves, so the engines sleep meanwhile with their weights kept on the
    host, and wake as they were (a model whose optimizer state and engine KV cache do not fit the
    device together still checkpoints)."""
    manager, trainers = run_handles(config)
    with timed() as saving:
        extra = {"rollout_id": rollout_id, "data_source": ray.get(manager.data_source_state.remote())}
        if engines_rest:
            ray.get(manager.offload.remote(keep_weights=True))
        try:
            paths = trainers.call("save", rollout_id, extra)
        finally:
            if engines_rest:
                ray.get(manager.onload_weights.remote())
                ray.get(manager.onload_kv.remote())
        get_run_logger().info("checkpoint of rollout %d: %s", rollout_id, paths[0])
    return {"path": paths[0], "t_save": saving.seconds}


@task(name="export-hf", retries=1, **TASK_DEFAULTS)
def export_hf(config: VimeConfig, path: str) -> str:
    """The trained model as an HF folder at `path` (local or the run's storage URI); returns
    where it is: `path`, or on an object store the folder its manifest names."""
    _, trainers = run_handles(config)
    return trainers.call("export_hf", path)[0]


@task(name="export-peft", retries=1, **TASK_DEFAULTS)
def export_peft(config: VimeConfig, path: str) -> str:
    """The LoRA adapter as a PEFT adapter folder at `path` (local or the run's storage URI); returns
    where it is, as export_hf."""
    _, trainers = run_handles(config)
    return trainers.call("export_peft", path)[0]


@task(name="compact-index", retries=2, **TASK_DEFAULTS)
def compact_index(config: VimeConfig) -> int:
    """Fold the run's per-batch manifests into one Parquet index file (lineage queries stay fast)."""
    try:
        return BatchStore.for_config(config).compact()
    except ValueError as exc:  # compaction only speeds lineage queries up: the run stands without it
        get_run_logger().warning("index not compacted: %s", exc)
        return -1
