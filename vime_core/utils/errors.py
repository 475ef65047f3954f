"""Errors that `vime_core/faults.py` classifies (the marker of an infrastructure failure, a trainer
out of device memory, a rollout trained half-way), kept in a leaf module so it can classify an
error without importing the package that raises it."""

from __future__ import annotations


class InfrastructureError(Exception):
    """A failure that a retry of the iteration can fix: a process died or could not be reached,
    and is replaced or comes back on the next try (vime_core/faults.py retries only these and
    Ray's, httpx's and botocore's own transport errors). An error class takes it as an extra
    base beside its own (`class EngineError(RuntimeError, InfrastructureError)`), so
    `except RuntimeError` still catches it."""


class TrainerOutOfMemoryError(RuntimeError):
    """A trainer call ran out of device memory. The same step with the same settings on the same
    device runs out again, so it is not retried (vime_core/faults.py); the message says which
    call, what the allocator reported, and the settings that decide that call's memory
    (vime_core/trainer/out_of_memory.py)."""


class PartiallyTrainedError(RuntimeError):
    """Training a rollout failed after some of its optimizer steps were applied: the weights are
    neither those before it nor those after it. The trainer refuses to train again until it is
    rebuilt from its last checkpoint (bootstrap does that: its state's diverged_rollout_id), so a
    retry never applies a step twice. `failure` is what failed, whose fault kind decides whether the
    iteration is retried (vime_core/faults.py); None for the refusal itself, which a rebuild ends."""

    def __init__(self, message: str, failure: BaseException | None = None) -> None:
        super().__init__(message)
        self.failure = failure


class StaleEnginesError(RuntimeError, InfrastructureError):
    """The weight check after a publish found engines whose log-probs of the probe are exactly
    those of the previous version while the trainer's moved: the publish did not reach their
    weights, whatever version they report. The engine fleet then reports them at version 0
    (EngineFleet.mark_weights_stale), so the iteration's retry (bootstrap first) publishes the trainer's weights again;
    a phase task's own retry would score the same stale weights and find nothing."""


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception's first non-empty line (at most `limit` characters), else its class name."""
    line = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return line[:limit] if line else type(exc).__name__
