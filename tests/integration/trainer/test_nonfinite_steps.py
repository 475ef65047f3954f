"""A non-finite loss or gradient never reaches the weights (vime_core/trainer/nonfinite.py), with a
real Megatron trainer on CPU: the step is skipped (weights, Adam's state and the schedule bit for
bit as before), counted, the next finite step trains, and one more than max_skipped_steps in a
row stops with one line; at DP=2 a NaN that only one rank sees makes both skip."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer
from tests.integration.trainer.nonfinite_workers import nan_on_one_rank_and_dump


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen3", True)


def _nan_batch() -> dict[str, list]:
    """hand_batch with one sample's advantage NaN: that sample's loss, so every gradient, is NaN."""
    batch = hand_batch()
    batch["advantage"][0] = math.nan
    return batch


def _state(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and every tensor of Adam's state (exp_avg, exp_avg_sq, step), cloned."""
    out = {f"param/{n}": p.detach().clone() for n, p in model.named_parameters()}
    for i, opt in enumerate(optimizer.chained_optimizers):
        for j, state in enumerate(opt.optimizer.state.values()):
            out.update({f"adam/{i}/{j}/{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _assert_bit_identical(now: dict[str, torch.Tensor], then: dict[str, torch.Tensor]) -> None:
    assert sorted(now) == sorted(then)
    for name, tensor in then.items():
        assert torch.equal(now[name], tensor), name


def _grad_buffers_are_zero(model) -> bool:
    return all(not b.grad_data.any() for b in model.buffers)


def test_a_nan_gradient_is_skipped_counted_and_too_many_in_a_row_stop(single_rank, ckpt, tmp_path):
    from vime_core.faults import classify
    from vime_core.trainer.nonfinite import NonFiniteStepsError

    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1, max_skipped_steps=2))
    assert trainer.train(0, hand_batch())["skipped_steps"] == 0  # Adam has state from here on
    before, lr_steps = _state(trainer.model, trainer.optimizer), trainer.scheduler.num_steps

    skipped = trainer.train(1, _nan_batch())
    assert skipped["skipped_steps"] == 1 and math.isnan(skipped["loss"]) and "grad_norm" not in skipped
    _assert_bit_identical(_state(trainer.model, trainer.optimizer), before)
    assert trainer.scheduler.num_steps == lr_steps and trainer.optimizer_steps == 1  # the schedule did not advance
    assert _grad_buffers_are_zero(trainer.model)
    assert trainer.last_trained_rollout_id == 1  # trained, on nothing: a retry does not run it again

    trained = trainer.train(2, hand_batch())  # a finite step trains as usual and resets the count
    assert trained["skipped_steps"] == 0 and math.isfinite(trained["loss"]) and trained["grad_norm"] > 0
    assert trainer.scheduler.num_steps == lr_steps + 1 and trainer.optimizer_steps == 2
    after = _state(trainer.model, trainer.optimizer)
    moved = [n for n in before if n.startswith("param/") and not torch.equal(after[n], before[n])]
    assert len(moved) == sum(1 for n in before if n.startswith("param/"))
    assert all(torch.isfinite(t).all() for t in after.values())

    assert trainer.train(3, _nan_batch())["skipped_steps"] == 1  # max_skipped_steps=2 in a row pass
    assert trainer.train(4, _nan_batch())["skipped_steps"] == 1
    with pytest.raises(NonFiniteStepsError) as err:
        trainer.train(5, _nan_batch())
    message = str(err.value)
    assert (
        message.startswith(
            "rollout 5: 3 policy optimizer steps in a row had a non-finite loss or gradient (max_skipped_steps=2)"
        )
        and "\n" not in message
    )
    assert not classify(err.value).retryable
    _assert_bit_identical(_state(trainer.model, trainer.optimizer), after)
    assert trainer.last_trained_rollout_id == 4 and trainer.optimizer_steps == 2


def test_the_critic_skips_a_non_finite_step_too(single_rank, ckpt, tmp_path):
    """ppo: a NaN advantage column makes the GAE returns of that sample NaN, so the value loss; the
    critic's step is skipped (its weights and Adam's state as before), and so is the policy's (the
    whitened advantages are all NaN)."""
    cfg = hand_config(ckpt, tmp_path, advantage_estimator="ppo", critic_lr=1e-3, num_steps_per_rollout=1)
    trainer = single_rank_trainer(cfg)
    trainer.train(0, hand_batch())
    critic, policy = _state(trainer.critic.model, trainer.critic.optimizer), _state(trainer.model, trainer.optimizer)
    metrics = trainer.train(1, _nan_batch())
    assert metrics["critic_skipped_steps"] == 1 and math.isnan(metrics["value_loss"])
    assert "critic_grad_norm" not in metrics and metrics["skipped_steps"] == 1
    _assert_bit_identical(_state(trainer.critic.model, trainer.critic.optimizer), critic)
    _assert_bit_identical(_state(trainer.model, trainer.optimizer), policy)
    assert _grad_buffers_are_zero(trainer.critic.model)
    again = trainer.train(2, hand_batch())
    assert again["critic_skipped_steps"] == 0 and again["critic_grad_norm"] > 0


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_a_nan_on_one_dp_rank_makes_both_skip(tmp_path, cache_dir, distributed_optimizer):
    """DP=2 over gloo: rank 1 alone finds a NaN in its reduced gradient; the flag's all-reduce
    makes rank 0 skip the step as well, so the replicas stay identical and untouched; also under
    the distributed optimizer, where each rank steps its own shard."""
    ckpt = tiny_checkpoint(cache_dir, "qwen3", True)
    args = (str(ckpt), str(tmp_path / "storage"), str(tmp_path), distributed_optimizer)
    spawn(nan_on_one_rank_and_dump, 2, 1, *args)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in ranks:
        assert [m["skipped_steps"] for m in r["metrics"]] == [0, 1, 0]
        _assert_bit_identical(r["after_skip"], r["before"])
        assert all(not torch.equal(r["after_next"][n], r["before"][n]) for n in r["before"])
        assert all(torch.isfinite(t).all() for t in r["after_next"].values())
        assert r["optimizer_steps"] == 2
    _assert_bit_identical(ranks[1]["after_next"], ranks[0]["after_next"])


def test_a_rollout_stopped_after_some_of_its_steps_applied_says_so(single_rank, ckpt, tmp_path):
    """Two steps per rollout, the second's sample NaN, max_skipped_steps=0: the first step was
    applied before the second stopped the run, so the weights are those of neither the last trained
    rollout nor this one; the trainer says which (run_actors rebuilds such a group from the last
    checkpoint rather than train that step twice). A rollout stopped with nothing applied does not."""
    from vime_core.trainer.nonfinite import NonFiniteStepsError

    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=2, max_skipped_steps=0))
    trainer.train(0, hand_batch())
    nothing_applied = hand_batch()
    nothing_applied["advantage"][0] = math.nan  # the first step's sample
    with pytest.raises(NonFiniteStepsError):
        trainer.train(1, nothing_applied)
    assert trainer.state()["diverged_rollout_id"] is None and trainer.last_trained_rollout_id == 0
    half = hand_batch()
    half["advantage"][2] = math.nan  # the second step's sample: the first step is applied
    with pytest.raises(NonFiniteStepsError, match=r"^rollout 1: 1 policy optimizer steps in a row"):
        trainer.train(1, half)
    assert trainer.state()["diverged_rollout_id"] == 1 and trainer.last_trained_rollout_id == 0


def test_a_rollout_that_failed_after_some_of_its_steps_is_never_trained_on_those_weights_again(
    single_rank, ckpt, tmp_path
):
    """Two steps per rollout; an error (not a NaN) after the first step was applied: the trainer
    says how many steps were applied and what failed, and refuses to train again on those weights,
    so neither a phase task's retry nor the iteration's applies that step twice; bootstrap rebuilds
    such a group from its last checkpoint (run_actors). An error before any step leaves the weights
    as they were: a retry then trains normally."""
    from types import SimpleNamespace

    from tasks.common import retry_unless_configuration
    from vime_core.faults import INFRASTRUCTURE, UNKNOWN, classify
    from vime_core.utils.errors import PartiallyTrainedError

    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=2))
    record = trainer.skips.record
    faults = {"before": 0, "after": 0}

    def failing_record(skipped):  # called after each optimizer step (trainer/nonfinite.py)
        if faults["before"]:
            faults["before"] -= 1
            raise RuntimeError("device fault before the step counted")
        record(skipped)
        if faults["after"]:
            faults["after"] -= 1
            raise RuntimeError("device fault after the step")

    trainer.skips.record = failing_record
    faults["before"] = 1
    with pytest.raises(RuntimeError, match="device fault before"):
        trainer.train(0, hand_batch())
    assert trainer.state()["diverged_rollout_id"] is None  # nothing applied: a retry is safe
    steps = trainer.optimizer_steps
    trainer.train(0, hand_batch())
    assert trainer.optimizer_steps == steps + 2 and trainer.last_trained_rollout_id == 0

    faults["after"] = 1
    with pytest.raises(PartiallyTrainedError) as failed:
        trainer.train(1, hand_batch())
    assert str(failed.value) == (
        "rollout 1: 1 optimizer step(s) were applied before training failed; the trainer is rebuilt from its "
        "last checkpoint before it trains again (RuntimeError: device fault after the step)"
    )
    assert trainer.state()["diverged_rollout_id"] == 1 and trainer.last_trained_rollout_id == 0
    fault = classify(failed.value)
    assert (fault.kind, fault.retryable) == (UNKNOWN, False)  # a bug stays a bug: the run stops
    assert not retry_unless_configuration(None, None, SimpleNamespace(data=failed.value))

    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    steps = trainer.optimizer_steps
    with pytest.raises(PartiallyTrainedError, match=r"^rollout 1: this trainer holds steps of rollout 1") as again:
        trainer.train(1, hand_batch())
    assert trainer.optimizer_steps == steps
    assert all(torch.equal(p, weights[n]) for n, p in trainer.model.named_parameters())
    fault = classify(again.value)  # the iteration's retry rebuilds the group, then trains
    assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True)
    assert not retry_unless_configuration(None, None, SimpleNamespace(data=again.value))
