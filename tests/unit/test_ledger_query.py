"""The compute ledger where a user reads it: `vime lineage --ledger` over a run's stored batches and
records (vime_core/report/ledger_query.py), the report task's ledger line and artifact, and the
run summary's totals. Stored counts are computed here from the batch dicts written."""

from __future__ import annotations

import json
import logging

import pytest

from vime_core.ledger import PhaseDevices, iteration_ledger, run_ledger
from vime_core.report.records import append_record, read_records
from vime_core.storage import BatchStore
from vime_core.storage.synthetic import synthetic_batch

RUN = "lq"


def _batch(seed: int) -> dict:
    batch = synthetic_batch(num_groups=3, group_size=4, max_response_len=6, seed=seed)
    batch["status"][1], batch["loss_mask"][1] = "failed", [0] * batch["response_length"][1]  # a reward failure
    return batch


def _ledger(batch: dict, surplus: int) -> dict:
    trainable = sum(sum(m) for m in batch["loss_mask"])
    failed = sum(n for n, s in zip(batch["response_length"], batch["status"]) if s == "failed")
    tokens = {
        "generated": trainable + failed + surplus,
        "trainable": trainable,
        "discarded": {"reward_failed": failed, "surplus": surplus},
    }
    return iteration_ledger(tokens, {"trained_tokens": trainable, "t_step": 2.0, "t_train": 1.0}, PhaseDevices())


@pytest.fixture
def stored_run(tmp_path):
    store = BatchStore(str(tmp_path))
    batches = {k: _batch(k) for k in (0, 1, 2)}
    for k, batch in batches.items():
        store.write(batch, {"run": RUN, "rollout_id": k})
    for k in (0, 1):
        append_record(str(tmp_path), RUN, {"rollout_id": k, "ledger": _ledger(batches[k], surplus=8 * (k + 1))})
    append_record(str(tmp_path), RUN, {"rollout_id": 2, "t_step": 1.0})  # written before the ledger existed
    return store, batches


def test_the_ledger_table_joins_stored_counts_with_the_records(stored_run):
    from vime_core.report.ledger_query import ledger_table

    store, batches = stored_run
    rows = ledger_table(store, RUN).to_pylist()
    assert [r["rollout_id"] for r in rows] == [0, 1, 2]
    for row in rows:
        b = batches[row["rollout_id"]]
        statuses = b["status"]
        assert row["stored_samples"] == len(statuses)
        assert row["stored_response_tokens"] == sum(b["response_length"])
        assert row["stored_trainable_tokens"] == sum(sum(m) for m in b["loss_mask"])
        assert row["stored_reward_failed_tokens"] == sum(
            n for n, s in zip(b["response_length"], statuses) if s == "failed"
        )
        assert row["stored_truncated_tokens"] == sum(
            sum(m) for m, s in zip(b["loss_mask"], statuses) if s == "truncated"
        )
    for row in rows[:2]:
        assert row["tokens_trained"] == row["stored_trainable_tokens"]
        assert row["tokens_discarded_reward_failed"] == row["stored_reward_failed_tokens"]
        assert row["tokens_discarded_surplus"] == 8 * (row["rollout_id"] + 1)
    assert rows[2]["tokens_generated"] is None  # a record without a ledger: the stored counts alone


def test_vime_lineage_ledger_prints_the_table(stored_run, capsys):
    from flows.cli import cmd_lineage

    store, _ = stored_run
    assert cmd_lineage(["--storage-uri", store.uri, "--run", RUN, "--ledger"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["rollout_id"] for r in rows] == [0, 1, 2] and "useful_share" in rows[0]
    with pytest.raises(SystemExit):
        cmd_lineage(["--storage-uri", store.uri, "--ledger"])  # needs --run
    assert "--ledger needs --run" in capsys.readouterr().err


def test_the_report_task_prints_the_ledger_line_and_makes_its_artifact(tmp_path, monkeypatch, capsys):
    import tasks.report as report
    from vime_core.config import VimeConfig

    artifacts = []
    monkeypatch.setattr(report, "get_run_logger", lambda: logging.getLogger("test-report"))
    monkeypatch.setattr(report, "create_table_artifact", lambda **kw: None)
    monkeypatch.setattr(report, "create_markdown_artifact", lambda **kw: artifacts.append(kw))
    monkeypatch.setattr(report.sys, "__stdout__", __import__("sys").stdout)
    cfg = VimeConfig(run_name="rep", storage_uri=str(tmp_path))
    tokens = {"generated": 40, "trainable": 30, "discarded": {"filter": 10}}
    ledger = iteration_ledger(tokens, {"trained_tokens": 30, "t_step": 1.0}, PhaseDevices())
    report.report_iteration.fn(cfg, 3, {"rollout_id": 3, "t_step": 1.0, "ledger": ledger}, draw_curve=False)
    printed = capsys.readouterr().out
    assert "ledger 3: generated 40 tok, trained 30 (75.0%); discarded filter 10" in printed
    (artifact,) = artifacts
    assert artifact["key"] == "rep-ledger" and "| discarded: filter | 10 | 25.0% |" in artifact["markdown"]
    assert read_records(str(tmp_path), "rep")[0]["ledger"] == ledger


def test_the_run_summary_totals_come_from_the_records(stored_run):
    store, batches = stored_run
    records = read_records(store.uri, RUN)
    total = run_ledger(r.get("ledger") for r in records)
    trained = sum(sum(sum(m) for m in batches[k]["loss_mask"]) for k in (0, 1))
    assert total["iterations"] == 2 and total["tokens_trained"] == trained
    assert total["tokens_discarded"]["surplus"] == 8 + 16
    assert total["useful_share"] == trained / total["tokens_generated"]
