"""A rollout whose training fails after some of its optimizer steps were applied, in a whole run on
real actors: a Ray head, one vLLM CPU engine behind vllm-router, one Megatron actor, Prefect.

Two optimizer steps per rollout. As rollout 2 trains, right after its first step was applied, one
of two faults (one run each):
- `collective`: the trainer's collective fails: torch's DistNetworkError, raised inside the trainer
  actor's process (a single rank has no peer to lose, so the error is raised where a lost peer would
  raise it). The trainer then holds half of rollout 2.
- `killed`: the trainer actor's process is SIGKILLed (it kills itself there, the one point where
  half of the rollout is certainly applied). Half of rollout 2 dies with it.
The train task does not call the trainer again (it would apply that step twice); the iteration's
retry rebuilds the trainer from the checkpoint of rollout 1 and trains rollout 2 from its stored
batch. The run must end as a run without the fault does: one trainable batch per rollout id, two
optimizer steps per rollout id, the engines at the trainer's weights after every sync, and rollout
2 trained exactly once by the rebuilt trainer.
"""

from __future__ import annotations

import functools
import os
import signal

import pytest

from tests.integration.flows.test_faults import _check_run, _handles, _raw_records, _trainer_pid

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

HALF_TRAINED = 2  # its training fails after its first step; the checkpoint is of rollout 1


def _fail_half_way_through(actor, rollout_id: int, fault: str) -> int:
    """In the trainer actor's process: as it trains `rollout_id` (once), its first optimizer step is
    applied and counted, then the collective after it fails, or the process is SIGKILLed (`fault`).
    Armed inside the actor, since training is submitted ahead of the train task that waits for it.
    Returns the actor's pid."""
    import ray

    def arm(self):
        trainer = self.trainer
        train, record = trainer.train, trainer.skips.record

        def fail_after_the_step(skipped):  # called after each optimizer step (trainer/nonfinite.py)
            record(skipped)
            trainer.skips.record = record
            if fault == "killed":
                os.kill(os.getpid(), signal.SIGKILL)
            import torch.distributed as dist

            raise dist.DistNetworkError("connection to rank 1 lost during the gradient all-reduce")

        def train_failing(rid, *args, **kwargs):
            if rid == rollout_id:
                trainer.train = train
                trainer.skips.record = fail_after_the_step
            return train(rid, *args, **kwargs)

        trainer.train = train_failing
        return os.getpid()

    return ray.get(actor.__ray_call__.remote(arm))


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, killed and not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module", params=["collective", "killed"])
def half_trained(request, tmp_path_factory, ray_head, tiny_model_dir):
    import tasks.train as train_task
    from flows.train import train
    from tests.integration.small_run import small_run_config
    from vime_core.cluster.run_actors import teardown

    cfg = small_run_config(
        run_name=f"half-trained-{request.param}",
        storage_uri=str(tmp_path_factory.mktemp("store")),
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
        num_rollout=4,
        num_steps_per_rollout=2,
        save_interval=2,  # checkpoints of rollouts 1 and 3
        check_weight_update_equal=True,
        iteration_retry_delay_s=0.5,
    )
    real = train_task.train.fn
    seen = {"calls": [], "pid": None}

    @functools.wraps(real)
    def fail_half_way(config, rollout_id, batch_ref, submitted=None):
        seen["calls"].append(rollout_id)
        if seen["pid"] is None:
            seen["pid"] = _fail_half_way_through(_handles(config)[1].actors[0], HALF_TRAINED, request.param)
        return real(config, rollout_id, batch_ref, submitted)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_task.train, "fn", fail_half_way)
        mp.setattr(train_task.train, "retry_delay_seconds", 0)
        summary = train(cfg)
    seen["fault"] = request.param
    yield cfg, summary, seen
    teardown(cfg.run_name)


def test_a_rollout_that_failed_half_trained_is_trained_once_by_a_rebuilt_trainer(half_trained):
    cfg, summary, seen = half_trained
    # one failed try of rollout 2, retried as an iteration: the task did not call the trainer again
    assert summary["failed_attempts"] == {HALF_TRAINED: 1}
    assert seen["calls"] == [0, 1, 2, 2, 3]
    _, trainers = _handles(cfg)
    assert _trainer_pid(trainers) != seen["pid"]  # the half-trained trainer was rebuilt, not reused
    if seen["fault"] == "killed":
        assert not _running(seen["pid"])  # the kill happened: the process is gone, not only left

    # every invariant of a run without the fault, the optimizer's step count first: 2 per rollout,
    # so the step applied before the failure is not in the weights
    _check_run(cfg, cfg.num_rollout)
    raw = _raw_records(cfg)
    assert [r["rollout_id"] for r in raw] == [0, 1, 2, 3]  # the failed try wrote no record
    assert raw[2]["from_store"] is True  # the rebuilt trainer trained the batch stored before the failure
