"""`vime train --advantage-estimator ppo` on real actors, stopped and started again: the default
job (the embedded tiny model and task) with its flags as the command line parses them, on a local
Ray head with one vLLM CPU engine behind vllm-router and one Megatron actor whose critic trains
beside the policy.

One run is shared by the module: 2 iterations with --critic-save, a checkpoint after each; its
actors torn down (what a stopped command leaves: the store and the checkpoints); then the same
run name with --num-rollout 3, whose new actors restore checkpoint 1 and go on with rollout 2.
Every iteration's record carries the critic's metrics; the resumed run trains each rollout id
once, on the weights and the critic the first run saved; each checkpoint's critic file is under
--critic-save and not beside the policy's. (The critic's math, its learning and its in-process
resume, with and without critic_save, are tested in tests/unit/test_value_loss.py,
tests/integration/trainer/test_learning.py and test_critic.py.)"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

RUN = "e2e-ppo"
FIRST, RESUMED = 2, 3  # --num-rollout of the first run and of the resumed one
# 1 for every other sample of a group: the untrained tiny model earns no arithmetic reward in a
# few iterations, and with returns of 0 the critic would never move from its zero head
REWARD = "tests.integration.rollout.hooks:index_reward"


@pytest.fixture(scope="module")
def resumed(tmp_path_factory, ray_head):
    """(the resumed run's configuration, its summary, the critic file checkpoint 1 held when the
    first run ended). The resumed run's actors live until the module's tests are done."""
    import torch

    from flows.train import train
    from vime_core.cluster.run_actors import teardown
    from vime_core.config import parse_args

    store, critics = tmp_path_factory.mktemp("store"), tmp_path_factory.mktemp("critics")

    def command(num_rollout: int):
        return parse_args(
            [
                "--advantage-estimator",
                "ppo",
                "--critic-lr",
                "1e-3",
                "--value-clip",
                "0.5",
                "--critic-save",
                str(critics),
                "--run-name",
                RUN,
                "--storage-uri",
                str(store),
                "--ray-address",
                ray_head,
                "--num-rollout",
                str(num_rollout),
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "4",
                "--micro-batch-size",
                "8",
                "--save-interval",
                "1",
                "--vllm-server-concurrency",
                "64",
                "--custom-rm-path",
                REWARD,
            ]
        )

    first = command(FIRST)
    assert (first.advantage_estimator, first.critic_lr, first.value_clip, first.device) == (
        "ppo",
        1e-3,
        0.5,
        "cpu",
    )  # the demo's device
    assert first.critic_save == str(critics)
    try:
        train(first)
    finally:
        teardown(RUN)  # the next command starts new actors, which restore the latest checkpoint
    saved = torch.load(
        critics / RUN / f"rollout_{FIRST - 1:06d}" / "critic_rank_0.pt", map_location="cpu", weights_only=False
    )
    cfg = command(RESUMED)
    try:
        yield cfg, train(cfg), saved
    finally:
        teardown(RUN)


def _raw_records(cfg) -> list[dict]:
    """Every line of metrics.jsonl, in the order written (read_records keeps one per id)."""
    from vime_core.report.records import METRICS, report_location

    text = report_location(cfg.storage_uri, cfg.run_name).get(METRICS).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _trainers(cfg):
    from vime_core.cluster.connect import ensure_ray
    from vime_core.cluster.run_actors import attach

    ensure_ray(cfg.ray_address)
    return attach(cfg)[1]


def test_every_iteration_trains_the_critic(resumed):
    cfg, _, _ = resumed
    records = {r["rollout_id"]: r for r in _raw_records(cfg)}
    assert sorted(records) == list(range(RESUMED))
    for record in records.values():
        assert record["num_steps"] == 1 and math.isfinite(record["train_loss"])
        assert math.isfinite(record["value_loss"]) and 0 <= record["value_clipfrac"] <= 1
        assert record["critic_lr"] == 1e-3 and math.isfinite(record["critic_grad_norm"])
    assert records[0]["value_mean"] == 0.0  # the zero-initialised head
    assert all(records[k]["value_mean"] != 0.0 for k in range(1, RESUMED))  # a trained head, the resumed one too


def test_the_resumed_run_goes_on_from_the_saved_iteration(resumed):
    """Each rollout id recorded once and in order (none trained twice, none skipped), each sampled
    on the weights trained through the one before (the resumed engines got the restored v3, not
    the starting weights), and the trainer's counters continue the saved ones."""
    cfg, summary, _ = resumed
    records = _raw_records(cfg)
    assert [r["rollout_id"] for r in records] == list(range(RESUMED))
    for k, record in enumerate(records):
        assert record["weight_version_min"] == record["weight_version_max"] == k + 1, record
        assert (record["version_before"], record["version_after"]) == (k + 1, k + 2)
        assert record["from_store"] is False and record["checkpoint"].endswith(f"rollout_{k:06d}")
    assert summary["iterations"] == RESUMED
    state = _trainers(cfg).rank0("state")
    assert (state["last_trained_rollout_id"], state["optimizer_steps"], state["weight_version"]) == (
        RESUMED - 1,
        RESUMED,
        RESUMED + 1,
    )


def test_the_critic_files_are_under_critic_save_and_not_in_the_checkpoint(resumed):
    from vime_core.trainer.checkpoint import read_manifest

    cfg, _, _ = resumed
    critics = Path(cfg.critic_save) / RUN
    for k, record in enumerate(_raw_records(cfg)):
        path = Path(record["checkpoint"])
        manifest = read_manifest(str(path))
        assert manifest["rollout_id"] == k and manifest["critic_files"] == ["critic_rank_0.pt"]
        assert manifest["critic_dir"] == str(critics / f"rollout_{k:06d}")
        assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "rank_0.pt"]
    assert sorted(str(p.relative_to(critics)) for p in critics.rglob("*") if p.is_file()) == [
        f"rollout_{k:06d}/critic_rank_0.pt" for k in range(RESUMED)
    ]


def test_the_resumed_critic_is_the_saved_one(resumed):
    """The first resumed rollout's value_mean is the mean of V_old, the critic's values before
    that rollout's update: it must be what the critic saved after rollout 1 computes over that
    batch, and not what checkpoint 0's critic (or a new one: 0) computes. Then the critic's
    schedule goes on from the saved step: checkpoint 2 holds one step more."""
    import ray
    import torch

    from vime_core.storage import BatchStore

    # in the actor's process; defined here so that Ray sends the function itself, not its module
    def in_actor(actor, critic_file: str, batch: dict) -> float:
        """In the trainer actor: the token mean of V_old over `batch`'s loss tokens (the record's
        value_mean) with the critic of `critic_file`, over the micro-batches the trainer packed
        the rollout into; the trainer's own critic is put back afterwards."""
        import copy

        import torch

        from vime_core.data.schedule import build_dp_schedule

        cfg, critic = actor.trainer.cfg, actor.trainer.critic  # TrainerActor's MegatronTrainer
        own = copy.deepcopy(critic.state())
        critic.load_state(torch.load(critic_file, map_location="cpu", weights_only=False), critic_file)
        try:
            schedule = build_dp_schedule(
                [len(t) for t in batch["tokens"]], cfg.global_batch_size, 1, cfg.micro_batch_size, None
            )
            values = critic.values(batch, [mb for step in schedule.micro_batches[0] for mb in step])
        finally:
            critic.load_state(own, "the trainer's own critic")
        masks = {i: torch.tensor(batch["loss_mask"][i], dtype=torch.float64) for i in values}
        return float(sum((values[i].double() * masks[i]).sum() for i in values) / sum(m.sum() for m in masks.values()))

    cfg, _, saved = resumed
    critics = Path(cfg.critic_save) / RUN
    batch, _ = BatchStore(cfg.storage_uri).read(RUN, FIRST)
    record = {r["rollout_id"]: r for r in _raw_records(cfg)}[FIRST]
    actor = _trainers(cfg).actors[0]

    def mean_value(k: int) -> float:
        critic_file = str(critics / f"rollout_{k:06d}" / "critic_rank_0.pt")
        return ray.get(actor.__ray_call__.remote(in_actor, critic_file, batch))

    assert record["value_mean"] == pytest.approx(mean_value(FIRST - 1), rel=1e-9, abs=1e-12)
    assert record["value_mean"] != pytest.approx(mean_value(FIRST - 2), rel=1e-6)

    after = torch.load(critics / f"rollout_{FIRST:06d}" / "critic_rank_0.pt", map_location="cpu", weights_only=False)
    assert saved["scheduler"]["num_steps"] == FIRST and after["scheduler"]["num_steps"] == FIRST + 1
