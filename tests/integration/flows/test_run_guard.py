"""The run guard on real actors (Ray head, one vLLM CPU engine behind vllm-router, one Megatron
actor, Prefect): a reward made bad in one rollout is caught before training, and training made
to breach is caught before its publish; each time the run stops with one line, the engines and
the checkpoints keep the last good weights, the iteration's batch is quarantined with its
lineage and unpublished, the breach is in guard.jsonl, and the same command resumes the run to
its end.

One run is shared by the module (engines take ~40 s to start on 2 cores); its fixture takes it
through the three runs of the same command and keeps what each left, which the tests read:
1. rollout 2's reward calls fail for half its samples (tests/integration/flows/guard_rewards.py;
   max_reward_failure_share 1 leaves them to the guard): stopped before training rollout 2;
2. the same command with guard_entropy_min above any entropy: rollout 2 is generated again
   (its prompts: the data source was rewound), trained, and stopped before its publish;
3. the same command with the defaults: the trainer is rebuilt from the checkpoint of rollout 1
   and the run ends.
"""

from __future__ import annotations

import io

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

NUM_ROLLOUT, BAD = 4, 2


def _config(store, model, ray_address, **over):
    from vime_core.demo.settings import demo_config

    base = dict(
        run_name="guard-stop",
        storage_uri=str(store),
        hf_checkpoint=str(model),
        ray_address=ray_address,
        num_rollout=NUM_ROLLOUT,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        micro_batch_size=8,
        save_interval=1,
        vllm_server_concurrency=64,
        custom_rm_path="tests.integration.flows.guard_rewards:fails_once_at_rollout_2",
        max_reward_failure_share=1.0,  # the rollout's own bound off: the guard's is tested
        iteration_retry_delay_s=0.5,
    )
    return demo_config(**{**base, **over})


def _state(cfg) -> dict:
    """What the run holds now: trainer, engines, records, breaches, batches, checkpoints."""
    import ray

    from tasks.guard import previous_breaches
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach
    from vime_core.report.records import read_records
    from vime_core.storage import BatchStore
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
    }


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
    import pyarrow.parquet as pq

    from vime_core.storage.fs import open_location
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
