"""The train flow on real actors, 2 iterations, with prompts from a local dataset folder
(`DatasetDict.save_to_disk`, columns named unlike the defaults): training reads the train split,
the eval reads the test split, and apply_chat_template_kwargs crosses Prefect and Ray into the
data source (the tiny model's template ignores the kwarg; the unit tests check it is applied).
The run (`dataset_run`, tests/integration/flows/conftest.py) is the one test_tracking_flow.py reads."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


def test_train_flow_on_a_local_dataset_folder(dataset_run, tiny_model_dir):
    from transformers import AutoTokenizer

    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore

    cfg, summary, train_rows, _ = dataset_run
    assert summary["iterations"] == 2
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    train_prompts = {r["question"] for r in train_rows}
    store = BatchStore(cfg.storage_uri)
    for k in range(2):
        batch, _ = store.read(cfg.run_name, k)
        assert len(batch["tokens"]) == 16
        prompts = {tok.decode(t[:n]) for t, n in zip(batch["tokens"], batch["prompt_length"])}
        assert prompts <= train_prompts, prompts - train_prompts  # the train split only
    records = read_records(cfg.storage_uri, cfg.run_name)
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert records[-1]["eval_reward_mean"] is not None  # the eval read the test split
