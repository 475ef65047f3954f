"""One step off-policy (`--async-staleness 1 --use-tis`) on real actors (Ray head, one vLLM CPU
engine behind vllm-router, one Megatron actor, Prefect): rollout k + 1 generates on the weights
trained through k - 1 while the trainer trains on k. Every batch is sampled by exactly the
weights the plan says (one version behind from rollout 1 on), each iteration records that lag,
every publish is checked against the trainer, each rollout id is trained once, and the run ends
with the engines on its last weights."""

from __future__ import annotations

import pytest
from tests.integration.flows.test_train_flow import LOGPROB_TOLERANCE  # vLLM CPU vs the trainer, fp32

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def off_policy_run(tmp_path_factory, ray_head, tiny_model_dir):
    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from tests.integration.small_run import small_run_config

    cfg = small_run_config(
        run_name="off-policy",
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=4,
        save_interval=2,
        check_weight_update_equal=True,
        async_staleness=1,
        use_tis=True,
    )
    summary = train(cfg)
    yield cfg, summary
    teardown(cfg.run_name)


def test_each_batch_is_sampled_one_version_behind_and_trained_once(off_policy_run):
    import ray

    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach
    from vime_core.report.records import read_records
    from vime_core.step_plan import version_before
    from vime_core.storage import BatchStore

    cfg, summary = off_policy_run
    assert summary["iterations"] == cfg.num_rollout
    store = BatchStore(cfg.storage_uri)
    for k in range(cfg.num_rollout):
        batch, _ = store.read(cfg.run_name, k)
        versions = {span["version"] for spans in batch["weight_versions"] for span in spans}
        expected = version_before(k) - (1 if k else 0)  # rollout 0: the bootstrap's weights, nothing to lag
        assert versions == {expected}, f"batch {k} was sampled by weights {versions}, expected v{expected}"
    records = read_records(cfg.storage_uri, cfg.run_name)
    assert [r["staleness"] for r in records] == [0] + [1] * (cfg.num_rollout - 1)
    assert all(r.get("prefetched") == 1.0 for r in records[1:]), [r.get("prefetched") for r in records]
    assert all(r.get("tis_weight") is not None for r in records)  # the lag is corrected
    ensure_ray(cfg.ray_address)
    manager, trainers = attach(cfg)
    state = trainers.rank0("state")
    assert state["last_trained_rollout_id"] == cfg.num_rollout - 1
    assert state["optimizer_steps"] == cfg.num_rollout * cfg.num_steps_per_rollout  # none twice
    assert ray.get(manager.weight_versions.remote()) == [version_before(cfg.num_rollout)] == [state["weight_version"]]


def test_every_publish_is_checked_against_the_trainer(off_policy_run):
    """Rollout 0's sync finds the engines on the bootstrap's weights and publishes nothing; every
    later one, and the last iteration's final publish, is checked."""
    from vime_core.report.records import read_records
    from vime_core.step_plan import version_before

    cfg, _ = off_policy_run
    checks = [r.get("weight_check") for r in read_records(cfg.storage_uri, cfg.run_name)]
    assert checks[0] is None
    last = cfg.num_rollout - 1  # its record keeps the final publish's check
    expected = [version_before(k) for k in range(1, last)] + [version_before(last) + 1]
    assert [c["version"] for c in checks[1:]] == expected
    assert all(c["max_abs_diff"] < LOGPROB_TOLERANCE for c in checks[1:]), checks
