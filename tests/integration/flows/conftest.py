"""The flow tests run their flows in this process, on the session's Ray head (`ray_head`,
tests/integration/conftest.py) and Prefect in ephemeral mode; each test uses its own run name.
One run is shared by two modules (`dataset_run`)."""

from __future__ import annotations

import json

import pytest


# W&B's key and credentials in configuration fields: no file the tracked run leaves may hold them
WANDB_SECRET = "wandb-key-that-must-not-be-written-9876543210"
FIELD_CANARIES = ("rm-pw-canary-41c7", "rm-key-canary-88e2", "hf-token-canary-05aa")


@pytest.fixture(scope="package")
def dataset_run(tmp_path_factory, ray_head, tiny_model_dir):
    """One 2-iteration train flow read by test_dataset_flow.py and test_tracking_flow.py (a run's
    start costs an engine's and a trainer's start): prompts from a local dataset folder whose
    columns are named unlike the defaults, and W&B (offline) and TensorBoard on, with credentials
    in its fields and W&B's key in its environment. Its actors are torn down when it ends: both
    modules read only what it left. Yields (configuration, summary, the train split's rows, the
    folder holding everything the run wrote)."""
    import datasets

    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from tests.integration.small_run import small_run_config
    from vime_core.demo.task import write_dataset

    root = tmp_path_factory.mktemp("dataset-run")
    rows = [json.loads(line) for line in write_dataset(root / "arith.jsonl", seed=0).read_text().splitlines()]
    renamed = [{"question": r["prompt"], "answer": r["label"]} for r in rows]
    folder = root / "arith-dataset"
    splits = {"train": renamed[8:], "test": renamed[:8]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(folder))

    store = root / "store"
    cfg = small_run_config(
        run_name="e2e-dataset",
        storage_uri=str(store),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=2,
        prompt_data=str(folder),
        input_key="question",
        label_key="answer",
        eval_prompt_data=str(folder),
        eval_prompt_data_split="test",
        eval_interval=2,
        apply_chat_template=True,
        apply_chat_template_kwargs={"enable_thinking": False},
        use_wandb=True,
        wandb_mode="offline",
        use_tensorboard=True,
        rm_url=f"https://bob:{FIELD_CANARIES[0]}@rm.invalid/score?token={FIELD_CANARIES[1]}",
        vllm_extra_args=["--hf-token", FIELD_CANARIES[2]],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_API_KEY", WANDB_SECRET)
        try:
            summary = train(cfg)
        finally:
            teardown(cfg.run_name)
    yield cfg, summary, splits["train"], store
