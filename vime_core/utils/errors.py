"""The marker of an infrastructure failure, kept in a leaf module so `vime_core/faults.py` can
classify an error without importing the package that raises it."""

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
    (vime_core/cluster/out_of_memory.py)."""
