"""The train flow on real actors, 2 iterations, with prompts from a local dataset folder
(`DatasetDict.save_to_disk`, columns named unlike the defaults): training reads the train split,
the eval reads the test split, and apply_chat_template_kwargs crosses Prefect and Ray into the
data source (the tiny model's template ignores the kwarg; the unit tests check it is applied)."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_train_flow_on_a_local_dataset_folder(tmp_path, ray_head, tiny_model_dir):
    datasets = pytest.importorskip("datasets")
    from transformers import AutoTokenizer

    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.demo.settings import demo_config
    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore
    from vime_core.demo.task import write_dataset

    rows = [json.loads(line) for line in write_dataset(tmp_path / "arith.jsonl", seed=0).read_text().splitlines()]
    renamed = [{"question": r["prompt"], "answer": r["label"]} for r in rows]
    folder = tmp_path / "arith-dataset"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(renamed[8:]),
            "test": datasets.Dataset.from_list(renamed[:8]),
        }
    ).save_to_disk(str(folder))

    cfg = demo_config(
        run_name="e2e-dataset",
        storage_uri=str(tmp_path / "store"),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=2,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        micro_batch_size=8,
        vllm_server_concurrency=64,
        prompt_data=str(folder),
        input_key="question",
        label_key="answer",
        eval_prompt_data=str(folder),
        eval_prompt_data_split="test",
        eval_interval=2,
        apply_chat_template=True,
        apply_chat_template_kwargs={"enable_thinking": False},
    )
    try:
        summary = train(cfg)
    finally:
        teardown(cfg.run_name)

    assert summary["iterations"] == 2
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    train_prompts = {r["question"] for r in renamed[8:]}
    store = BatchStore(cfg.storage_uri)
    for k in range(2):
        batch, _ = store.read(cfg.run_name, k)
        assert len(batch["tokens"]) == 16
        prompts = {tok.decode(t[:n]) for t, n in zip(batch["tokens"], batch["prompt_length"])}
        assert prompts <= train_prompts, prompts - train_prompts  # the train split only
    records = read_records(cfg.storage_uri, cfg.run_name)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert records[-1]["eval_reward_mean"] is not None  # the eval read the test split
