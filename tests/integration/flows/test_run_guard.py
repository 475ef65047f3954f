"""The run guard on real actors (Ray head, one vLLM CPU engine behind vllm-router, one Megatron
actor, Prefect): a reward made bad in one rollout is caught before training, and training made
to breach is caught before its publish; each time the run stops with one line, the engines and
the checkpoints keep the last good weights, the iteration's batch is quarantined with its
lineage and unpublished, the breach is in guard.jsonl, and the same command resumes the run to
its end.

One run is shared by the module (engines take ~40 s to start on 2 cores); its fixture takes it
through five runs of the same command and keeps what each left, which the tests read:
1. rollout 2's reward calls fail for half its samples (tests/integration/flows/guard_rewards.py;
   max_reward_failure_share 1 leaves them to the guard): stopped before training rollout 2;
2. the same command with guard_entropy_min above any entropy: rollout 2 is generated again
   (its prompts: the data source was rewound), trained, and stopped before its publish;
3. the same command with the defaults: the trainer is rebuilt from the checkpoint of rollout 1
   and the run ends at rollout 3;
4. extended to rollout 5 with guard_action rollback: rollout 5's reward calls fail once; the
   iteration is rolled back and run again on the same prompts, and the run ends;
5. extended to rollout 6 with guard_action rollback, guard_retries 1 and the entropy floor: the
   trainer is rolled back to its checkpoint of rollout 5, the iteration breaches again, and the
   run stops saying it was rolled back once.
"""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest

from vime_core.storage import BatchStore
from vime_core.storage.fs import open_location

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

NUM_ROLLOUT, BAD = 4, 2  # the first three runs; then rollouts 4-5 (rollback) and 6 (rolled back, stopped)
BAD_AGAIN, LAST = 5, 6


def _config(store, model, ray_address, **over):
    from tests.integration.small_run import small_run_config

    base = dict(
        run_name="guard-stop",
        storage_uri=str(store),
        hf_checkpoint=str(model),
        ray_address=ray_address,
        num_rollout=NUM_ROLLOUT,
        save_interval=2,  # checkpoints of rollouts 1, 3, 5 and the last
        custom_rm_path="tests.integration.flows.guard_rewards:fails_once_at_rollouts_2_and_5",
        max_reward_failure_share=1.0,  # the rollout's own bound off: the guard's is tested
        iteration_retry_delay_s=0.5,
    )
    return small_run_config(**{**base, **over})


def _state(cfg) -> dict:
    """What the run holds now: trainer, engines, records, breaches, batches, checkpoints."""
    import ray

    from tasks.guard import previous_breaches
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach
    from vime_core.report.records import read_records
    from vime_core.trainer.checkpoint import latest_checkpoint

    ensure_ray(cfg.ray_address)
    manager, trainers = attach(cfg)
    store = BatchStore(cfg.storage_uri)
    return {
        "trainer": trainers.rank0("state"),
        "engines": ray.get(manager.weight_versions.remote()),
        "records": [r["rollout_id"] for r in read_records(cfg.storage_uri, cfg.run_name)],
        "breaches": previous_breaches(cfg),
        "batches": [b.rollout_id for b in store.list_batches(cfg.run_name)],
        "quarantined": store.quarantined(cfg.run_name),
        "checkpoint": latest_checkpoint(cfg),
        "full_records": read_records(cfg.storage_uri, cfg.run_name),
        "prompt_ids": {
            b.rollout_id: _prompt_ids(store.read_table(cfg.run_name, b.rollout_id))
            for b in store.list_batches(cfg.run_name)
        },
    }


def _prompt_ids(table) -> list[str]:
    from vime_core.storage.schema import lineage_of

    return list(lineage_of(table)["prompt_ids"])


@pytest.fixture(scope="module")
def guarded_run(tmp_path_factory, ray_head, tiny_model_dir):
    import flows.train as train_flow
    from vime_core.cluster.run_actors import teardown

    cfg = _config(tmp_path_factory.mktemp("store"), tiny_model_dir, ray_head)
    seen: dict = {}
    with pytest.raises(train_flow.IterationFailedError) as info:
        train_flow.train(cfg)
    seen["reward"] = (str(info.value), _state(cfg))
    strict = cfg.model_copy(update={"guard_entropy_min": 100.0})
    with pytest.raises(train_flow.IterationFailedError) as info:
        train_flow.train(strict)
    seen["entropy"] = (str(info.value), _state(cfg))
    seen["summary"] = train_flow.train(cfg)
    seen["end"] = _state(cfg)
    rollback = cfg.model_copy(update={"num_rollout": BAD_AGAIN + 1, "guard_action": "rollback"})
    seen["rollback_summary"] = train_flow.train(rollback)
    seen["rolled_back"] = _state(cfg)
    exhausted = rollback.model_copy(update={"num_rollout": LAST + 1, "guard_retries": 1, "guard_entropy_min": 100.0})
    with pytest.raises(train_flow.IterationFailedError) as info:
        train_flow.train(exhausted)
    seen["exhausted"] = (str(info.value), _state(cfg))
    yield cfg, seen
    teardown(cfg.run_name)


def test_a_bad_reward_stops_the_run_before_training(guarded_run):
    cfg, seen = guarded_run
    message, state = seen["reward"]
    assert message.startswith(f"iteration {BAD} failed: run guard stopped rollout {BAD}: reward-failures: 50.0%")
    assert "guard_reward_failure_share=0.1" in message and "\n" not in message
    # nothing trained on it, nothing published, no checkpoint of it
    assert state["trainer"]["last_trained_rollout_id"] == BAD - 1
    assert state["trainer"]["optimizer_steps"] == BAD * cfg.num_steps_per_rollout
    assert state["trainer"]["diverged_rollout_id"] is None
    assert state["engines"] == [BAD + 1]
    assert state["checkpoint"].endswith(f"rollout_{BAD - 1:06d}")
    assert state["records"] == list(range(BAD)) and state["batches"] == list(range(BAD))
    (breach,) = state["breaches"]
    assert breach["rollout_id"] == BAD and breach["phase"] == "rollout" and breach["data_source_rewound"]
    (check,) = breach["guard_breaches"]
    assert (check["check"], check["metric"], check["limit"]) == ("reward-failures", "reward_failure_share", 0.1)
    assert check["value"] == breach["metrics"]["reward_failed_count"] / (
        cfg.rollout_batch_size * cfg.n_samples_per_prompt
    )
    (quarantined,) = state["quarantined"]
    assert quarantined["rollout_id"] == BAD
    assert quarantined["reason"] == message.split(": ", 1)[1].split(" (GuardBreachError)")[0]
    assert breach["discarded_batch"]["quarantined_key"] == quarantined["quarantined_key"]


def test_the_quarantined_batch_keeps_its_lineage(guarded_run):
    """The discarded batch is kept aside whole: its rows, the failed samples, its lineage."""
    from vime_core.storage.schema import lineage_of

    cfg, seen = guarded_run
    _, state = seen["reward"]
    quarantined = state["quarantined"][0]
    data = open_location(cfg.storage_uri).get(quarantined["quarantined_key"])
    table = pq.read_table(io.BytesIO(data))
    lineage = lineage_of(table)
    assert lineage["run"] == cfg.run_name and lineage["rollout_id"] == BAD
    assert table.num_rows == cfg.rollout_batch_size * cfg.n_samples_per_prompt
    statuses = table.column("status").to_pylist()
    assert statuses.count("failed") == seen["reward"][1]["breaches"][0]["metrics"]["reward_failed_count"]


def test_a_breach_after_training_is_not_published_nor_saved(guarded_run):
    cfg, seen = guarded_run
    message, state = seen["entropy"]
    assert f"run guard stopped rollout {BAD}: entropy-floor: entropy" in message and "guard_entropy_min=100" in message
    # trained, but held back: the engines keep v(BAD + 1), no checkpoint of it, a rebuild is due
    assert state["trainer"]["last_trained_rollout_id"] == BAD
    assert state["trainer"]["diverged_rollout_id"] == BAD
    assert state["engines"] == [BAD + 1]
    assert state["checkpoint"].endswith(f"rollout_{BAD - 1:06d}")
    assert state["records"] == list(range(BAD)) and state["batches"] == list(range(BAD))
    first, second = state["breaches"]
    assert second["phase"] == "train" and second["trainer_rebuilt_from_checkpoint"]
    assert [b["check"] for b in second["guard_breaches"]] == ["entropy-floor"]
    assert second["metrics"]["reward_failed_count"] == 0  # the same prompts, scored normally this time
    assert len(state["quarantined"]) == 2
    assert second["discarded_batch"]["checksum"] != first["discarded_batch"]["checksum"]


def test_the_same_command_resumes_from_the_last_good_checkpoint(guarded_run):
    cfg, seen = guarded_run
    end = seen["end"]
    assert end["records"] == list(range(NUM_ROLLOUT)) and end["batches"] == list(range(NUM_ROLLOUT))
    assert end["trainer"]["last_trained_rollout_id"] == NUM_ROLLOUT - 1
    assert end["trainer"]["diverged_rollout_id"] is None
    # rebuilt from rollout 1's checkpoint: one optimizer step per rollout id, none twice
    assert end["trainer"]["optimizer_steps"] == NUM_ROLLOUT * cfg.num_steps_per_rollout
    assert end["engines"] == [NUM_ROLLOUT + 1]
    assert len(end["breaches"]) == 2  # the history of breaches stays
    assert seen["summary"]["iterations"] == NUM_ROLLOUT
    assert end["breaches"][0]["guard_history"]["accepted_records"] == BAD


def test_rollback_runs_the_iteration_again_on_the_same_prompts(guarded_run):
    cfg, seen = guarded_run
    state = seen["rolled_back"]
    assert seen["rollback_summary"]["failed_attempts"] == {BAD_AGAIN: 1}
    assert state["records"] == list(range(BAD_AGAIN + 1)) and state["batches"] == list(range(BAD_AGAIN + 1))
    assert state["trainer"]["optimizer_steps"] == (BAD_AGAIN + 1) * cfg.num_steps_per_rollout
    assert state["engines"] == [BAD_AGAIN + 2]
    breach = state["breaches"][-1]
    assert (breach["rollout_id"], breach["phase"], breach["guard_action"]) == (BAD_AGAIN, "rollout", "rollback")
    record = state["full_records"][BAD_AGAIN]
    assert record["guard_breaches_before"] == 1 and record["reward_failed_count"] == 0
    assert all(r["guard_breaches_before"] == 0 for r in state["full_records"][NUM_ROLLOUT:BAD_AGAIN])
    # the data cursor went back: the stored batch holds the prompts of the discarded one, new samples
    discarded = state["quarantined"][-1]
    assert discarded["rollout_id"] == BAD_AGAIN
    table = pq.read_table(io.BytesIO(open_location(cfg.storage_uri).get(discarded["quarantined_key"])))
    assert _prompt_ids(table) == state["prompt_ids"][BAD_AGAIN]
    assert discarded["checksum"] != next(
        b["checksum"] for b in BatchStore(cfg.storage_uri).index().to_pylist() if b["rollout_id"] == BAD_AGAIN
    )


def test_rollback_rebuilds_the_trainer_then_stops_after_guard_retries(guarded_run):
    cfg, seen = guarded_run
    message, state = seen["exhausted"]
    assert message.startswith(f"iteration {LAST} failed: run guard stopped rollout {LAST}: entropy-floor:")
    assert "after 1 rollback(s) (guard_retries=1)" in message and "\n" not in message
    last_two = state["breaches"][-2:]
    assert [(b["rollout_id"], b["attempt"], b["phase"]) for b in last_two] == [(LAST, 1, "train"), (LAST, 2, "train")]
    assert all(b["trainer_rebuilt_from_checkpoint"] for b in last_two)
    # each attempt trained on a fresh rollout of the same prompts, from the checkpoint of rollout 5
    assert last_two[0]["discarded_batch"]["checksum"] != last_two[1]["discarded_batch"]["checksum"]
    assert state["trainer"]["diverged_rollout_id"] == LAST
    assert state["engines"] == [LAST + 1]  # v7: what rollout 5 trained; the breaching steps never published
    assert state["checkpoint"].endswith(f"rollout_{BAD_AGAIN:06d}")
    assert state["records"] == list(range(LAST)) and state["batches"] == list(range(LAST))
