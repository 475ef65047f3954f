"""The small run the whole-run integration tests make (flows, storage, cluster): 4 prompts x 4
samples a rollout, micro-batches of 8 samples, every sample in flight at once, on the demo's
settings. One place for it, so a change of the demo's defaults reaches every such test alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from vime_core.demo.settings import demo_config

SMALL_RUN = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "micro_batch_size": 8, "vllm_server_concurrency": 64}


def small_run_config(
    run_name: str, storage_uri: Union[str, Path], hf_checkpoint: Union[str, Path], ray_address: str, **fields: Any
):
    """The demo configuration of a small run `run_name`; `fields`: the test's own, over SMALL_RUN."""
    return demo_config(
        run_name=run_name,
        storage_uri=str(storage_uri),
        hf_checkpoint=str(hf_checkpoint),
        ray_address=ray_address,
        **{**SMALL_RUN, **fields},
    )
