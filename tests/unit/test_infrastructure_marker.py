"""vime's infrastructure errors carry the InfrastructureError marker (vime_core/utils/errors.py),
which is what vime_core/faults.py retries: found raw, after crossing Ray pickled, under a
RayTaskError and down a `raise ... from` chain under an unlisted wrapper; and each keeps its own base, so
`except RuntimeError` still catches it."""

from __future__ import annotations

import pytest
import ray.cloudpickle as cloudpickle

from vime_core.faults import INFRASTRUCTURE, classify
from vime_core.utils.errors import InfrastructureError


def _instances():
    from vime_core.cluster.errors import ActorsMissingError
    from vime_core.engines.client import EngineError, EngineWakeError
    from vime_core.engines.router import RouterError
    from vime_core.engines.server import EngineStartError
    from vime_core.rollout.loop import RolloutFailedError
    from vime_core.weight_sync.publish import PublishError

    return [
        ActorsMissingError("run 'r' has no trainer-0", ("trainer-0",)),
        EngineError("engine-0", "/inference/v1/generate", None, "connection refused"),
        EngineWakeError("engine-2", ["weights"], 500, "CUDA Error: out of memory"),
        RouterError("router exited with code 1"),
        EngineStartError("engine-0: vLLM server exited with code 1"),
        RolloutFailedError("no engine answered /health within 600 s (engines: e0)"),
        PublishError("publish v3: engine-0 reports 2", bytes_moved=True),
    ]


def _remote(cause: BaseException):
    """How an exception raised inside a Ray actor reaches the caller."""
    from ray.exceptions import RayTaskError

    return RayTaskError("train", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()


def _chained(cause: BaseException):
    try:
        raise cause
    except InfrastructureError as err:
        try:
            raise RuntimeError("phase failed") from err
        except RuntimeError as wrapper:
            return wrapper


@pytest.mark.parametrize("exc", _instances(), ids=lambda e: type(e).__name__)
def test_a_marked_error_is_infrastructure_however_it_arrives(exc):
    assert isinstance(exc, RuntimeError) and isinstance(exc, InfrastructureError)
    pickled = cloudpickle.loads(cloudpickle.dumps(exc))
    for arrived in (exc, pickled, _remote(pickled), _chained(exc)):
        fault = classify(arrived)
        assert (fault.kind, fault.retryable, fault.error_type) == (INFRASTRUCTURE, True, type(exc).__name__)
