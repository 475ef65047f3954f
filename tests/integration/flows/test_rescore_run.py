"""A real short run of the default job (Ray head, vLLM CPU engine behind vllm-router, Megatron actor,
Prefect): its records carry a compute ledger that balances and agrees with the stored batches, and
its stored samples scored again by the task's reward changed on purpose (index 0 of every group
flipped) give a blast radius of exactly those samples; replay then trains on the re-scored batch
and lands on other weights than the run's own checkpoint."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
THIS = __file__
RUN = "e2e-rescore"


def flipped_on_index_0(sample) -> float:
    """The default task's reward, flipped for index 0 of every group: every such sample changes."""
    from vime_core.demo.task import reward

    value = reward(sample)
    return 1.0 - value if sample.index == 0 else value


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ray_head, tiny_model_dir):
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from tests.integration.small_run import small_run_config

    cfg = small_run_config(
        run_name=RUN,
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=2,
        save_interval=1,
    )
    summary = train(cfg)
    yield cfg, summary
    teardown(cfg.run_name)


def test_every_iteration_records_a_ledger_that_balances_and_matches_its_batch(trained):
    from vime_core.ledger import CAUSES
    from vime_core.report.ledger_query import ledger_table
    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore

    cfg, summary = trained
    records = read_records(cfg.storage_uri, cfg.run_name)
    table = {r["rollout_id"]: r for r in ledger_table(BatchStore(cfg.storage_uri), cfg.run_name).to_pylist()}
    assert sorted(table) == [r["rollout_id"] for r in records] == list(range(cfg.num_rollout))
    for record in records:
        ledger, row = record["ledger"], table[record["rollout_id"]]
        discarded = sum(ledger["tokens_discarded"].values())
        assert ledger["tokens_generated"] > 0 and set(ledger["tokens_discarded"]) == set(CAUSES)
        assert ledger["tokens_generated"] == ledger["tokens_trained"] + discarded  # every token accounted for
        assert ledger["tokens_unaccounted"] == 0
        # the trainer trained what the stored batch holds as trainable, less skipped steps
        assert row["stored_trainable_tokens"] == ledger["tokens_trained"] + ledger["tokens_discarded"]["skipped_steps"]
        assert ledger["tokens_discarded"]["reward_failed"] == row["stored_reward_failed_tokens"]
        assert ledger["useful_share"] == ledger["tokens_trained"] / ledger["tokens_generated"]
        assert ledger["device_s"]["train"] == record["t_train"] * ledger["devices"]["trainer"]
        assert ledger["device_s_held"] == record["t_step"] * ledger["devices"]["run"]
    total = summary["ledger"]
    assert total["tokens_trained"] == sum(r["ledger"]["tokens_trained"] for r in records)
    assert total["iterations"] == cfg.num_rollout


def test_rescore_names_the_changed_samples_and_replay_trains_on_them(trained):
    from flows.replay import replay
    from vime_core.cluster.run_actors import teardown
    from vime_core.rescore import rescore_run
    from vime_core.storage import BatchStore
    from vime_core.trainer.checkpoint import checkpoint_dir, load_rank_state

    cfg, _ = trained
    store = BatchStore(cfg.storage_uri)
    result = rescore_run(cfg.storage_uri, cfg.run_name, f"{THIS}:flipped_on_index_0")
    for it in result["iterations"]:
        k = it["rollout_id"]
        batch, _ = store.read(cfg.run_name, k)
        assert [c["row"] for c in it["changed"]] == [i for i, index in enumerate(batch["index"]) if index == 0]
        assert all(c["raw_reward"] == 1.0 - c["raw_reward_before"] for c in it["changed"])
        assert it["groups"] == sorted(set(batch["group_index"]))
        assert [p.rsplit("/", 1)[-1] for p in it["checkpoints"]] == [
            f"rollout_{j:06d}" for j in range(cfg.num_rollout) if j >= k
        ]

    def weights(path):
        return load_rank_state(path, 0, 1, 1)["model"]

    replay_cfg = cfg.model_copy(update={"run_name": "e2e-rescore-replay"})
    try:
        out = replay(
            replay_cfg, source_run=cfg.run_name, checkpoint=checkpoint_dir(cfg, 0), rollout_ids=[1], rewards="rescored"
        )
        assert out["metrics"][1]["rewards"] == f"v{result['version']}"
        original, replayed = weights(checkpoint_dir(cfg, 1)), weights(out["checkpoint"])
        # trained on other advantages from the same weights: the weights differ from the run's own
        assert any(hasattr(v, "shape") and not (v == replayed[k]).all() for k, v in original.items())
    finally:
        teardown(replay_cfg.run_name)
