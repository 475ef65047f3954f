"""A trainer call that runs out of device memory (vime_core/trainer/out_of_memory.py): the actor
raises one line naming the call, the settings that decide its memory and torch's own figures; the
run stops on it at once (not retried: the same step runs out again), at start or in an iteration."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from vime_core.trainer.out_of_memory import SETTINGS_BY_CALL, is_out_of_memory
from vime_core.cluster.trainer_group import TrainerActor
from vime_core.faults import DEVICE_MEMORY, classify
from vime_core.utils.errors import TrainerOutOfMemoryError

# torch's message, as the H100 run of the 14B LoRA model printed it at its startup publish
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 1.45 GiB. GPU 0 has a total capacity of 79.18 GiB of which "
    "678.62 MiB is free. Including non-PyTorch memory, this process has 33.48 GiB memory in use. Process "
    "2365 has 44.93 GiB memory in use. Of the allocated memory 30.96 GiB is allocated by PyTorch, and 1.31 "
    "GiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
    "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)"
)


def _actor(method: str, exc: BaseException) -> TrainerActor:
    """A TrainerActor whose trainer's `method` raises `exc` (the trainer itself is not built)."""

    def fail(*args, **kwargs):
        raise exc

    actor = TrainerActor.__new__(TrainerActor)
    actor.trainer = SimpleNamespace(**{method: fail})
    return actor


def _remote(cause: BaseException):
    from ray.exceptions import RayTaskError

    return RayTaskError("MegatronTrainer.call", "Traceback ...", cause).as_instanceof_cause()


def test_the_actor_names_the_call_its_settings_and_the_allocators_figures():
    with pytest.raises(TrainerOutOfMemoryError) as info:
        _actor("publish", torch.OutOfMemoryError(TORCH_OOM)).call("publish", ["http://e0"], 1)
    line = str(info.value)
    assert "\n" not in line
    assert line.startswith(
        f"trainer publish ran out of device memory; settings that decide its memory: "
        f"{SETTINGS_BY_CALL['publish']} (CUDA out of memory. Tried to allocate 1.45 GiB."
    )
    assert "this process has 33.48 GiB" in line and "unallocated." in line
    assert "expandable_segments" not in line  # torch's allocator advice is left out: the settings are what to change
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


def test_other_errors_pass_through_unchanged():
    error = ValueError("batch: response_length=0")
    with pytest.raises(ValueError) as info:
        _actor("train", error).call("train", 0, {})
    assert info.value is error
    assert not is_out_of_memory(error) and is_out_of_memory(torch.OutOfMemoryError("x"))


def test_an_out_of_memory_call_is_not_retried_anywhere_and_reads_in_one_line(monkeypatch):
    import flows.train as train_flow
    from tasks.common import retry_rebuilding_actors, retry_unless_configuration

    with pytest.raises(TrainerOutOfMemoryError) as info:
        _actor("train", torch.OutOfMemoryError(TORCH_OOM)).call("train", 0, {})
    remote = _remote(info.value)
    fault = classify(remote)
    assert (fault.kind, fault.retryable, fault.what) == (DEVICE_MEMORY, False, str(info.value))
    state = SimpleNamespace(data=remote)
    assert not retry_unless_configuration(None, None, state) and not retry_rebuilding_actors(None, None, state)

    lines = []
    log = logging.getLogger("test-trainer-oom")
    monkeypatch.setattr(log, "error", lambda msg, *a: lines.append(msg % a if a else msg))
    monkeypatch.setattr(train_flow, "get_run_logger", lambda: log)
    err = train_flow.start_failed(remote)
    assert lines == [str(err)]
    assert str(err).startswith("the run could not start: trainer train ran out of device memory; settings that ")
    assert str(err).endswith(f"(TrainerOutOfMemoryError); {train_flow.OUT_OF_MEMORY_ADVICE}")
    cfg = SimpleNamespace(iteration_retries=2, guard_action="stop", guard_retries=0)
    monkeypatch.setattr(train_flow, "rollback_due", lambda config, exc, failed: None)
    with pytest.raises(train_flow.IterationFailedError, match="not retried \\(the same step runs out again\\)"):
        train_flow.retry_or_raise(cfg, 3, remote, 1)
