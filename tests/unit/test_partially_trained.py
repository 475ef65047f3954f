"""A rollout whose training failed after some of its steps were applied (PartiallyTrainedError):
judged by what failed, never retried by a phase task (only a rebuilt trainer may train again),
and it crosses Ray with its failure. The trainer's side: tests/integration/trainer/test_nonfinite_steps.py."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import torch

from tasks.common import retry_rebuilding_actors, retry_unless_configuration
from vime_core.faults import DEVICE_MEMORY, INFRASTRUCTURE, UNKNOWN, classify
from vime_core.trainer.trainer import partially_trained
from vime_core.utils.errors import PartiallyTrainedError


def _remote(cause: BaseException):
    """`cause` as the driver receives it from an actor: pickled inside Ray's RayTaskError."""
    from ray.exceptions import RayTaskError

    sent = pickle.dumps(RayTaskError("MegatronTrainer.train", "Traceback ...", cause))
    return pickle.loads(sent).as_instanceof_cause()


def test_what_failed_decides_the_kind_and_no_phase_task_retries_it():
    cases = [
        (RuntimeError("a bug"), UNKNOWN, False),
        (ConnectionResetError("nccl peer reset"), INFRASTRUCTURE, True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."), DEVICE_MEMORY, False),
        (None, INFRASTRUCTURE, True),  # the refusal to train on such weights: a rebuild ends it
    ]
    for failure, kind, retryable in cases:
        err = (
            partially_trained(4, 2, failure)
            if failure is not None
            else PartiallyTrainedError("rollout 4: this trainer holds steps of rollout 4 applied before it failed")
        )
        remote = _remote(err)
        fault = classify(remote)
        assert (fault.kind, fault.retryable, fault.error_type) == (kind, retryable, "PartiallyTrainedError")
        assert not retry_unless_configuration(None, None, SimpleNamespace(data=remote))
    oom = partially_trained(4, 2, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB."))
    assert "(TrainerOutOfMemoryError: trainer train ran out of device memory; settings" in str(oom)
    assert str(oom).startswith("rollout 4: 2 optimizer step(s) were applied before training failed; the trainer")
    assert retry_rebuilding_actors(None, None, SimpleNamespace(data=_remote(partially_trained(4, 1, OSError("x")))))
