"""Every vime exception with arguments of its own survives pickling as Ray does it (an error
raised in an actor reaches the driver pickled): same class, message and attributes. An
exception that cannot be rebuilt arrives as Ray's UnserializableException, which hides what
happened and is not retried (bench/bench_faults.py found EngineError doing that)."""

from __future__ import annotations

import pytest
import ray.cloudpickle as cloudpickle


def _instances():
    from vime_core.cluster.errors import ActorsMissingError
    from vime_core.engines.client import EngineError, EngineWakeError
    from vime_core.rewards.values import InvalidRewardError
    from vime_core.storage.store import CorruptBatchError
    from vime_core.utils.errors import PartiallyTrainedError
    from vime_core.weight_sync.publish import PublishError

    return [
        (
            EngineError("engine-0", "/inference/v1/generate", None, "connection refused"),
            ("engine", "endpoint", "status", "body"),
        ),
        (EngineError("engine-1", "/pause", 503, "x" * 10), ("engine", "endpoint", "status", "body")),
        (
            EngineWakeError("engine-2", ["weights"], 500, "CUDA Error: out of memory"),
            ("engine", "endpoint", "status", "tags", "why"),
        ),
        (PublishError("publish v3: engine-0 reports 2", bytes_moved=True), ("bytes_moved",)),
        (ActorsMissingError("run 'r' has no trainer-0", ("trainer-0",)), ("missing",)),
        (CorruptBatchError("batches/r/00000001.parquet", "checksum mismatch"), ("key", "detail")),
        (InvalidRewardError("returned str"), ("what", "expected")),
        # with a failure: tests/unit/test_partially_trained.py (exceptions do not compare by value)
        (PartiallyTrainedError("rollout 1: this trainer holds steps of rollout 1"), ("failure",)),
    ]


@pytest.mark.parametrize(
    "exc, attributes", _instances(), ids=lambda x: type(x).__name__ if isinstance(x, Exception) else ""
)
def test_a_vime_exception_is_rebuilt_after_pickling(exc, attributes):
    back = cloudpickle.loads(cloudpickle.dumps(exc))
    assert type(back) is type(exc) and str(back) == str(exc)
    assert all(getattr(back, a) == getattr(exc, a) for a in attributes)


def test_every_exception_class_with_its_own_init_is_covered():
    """A new exception class with its own __init__ must be added above."""
    import importlib
    import inspect
    import pkgutil

    import vime_core

    covered = {type(e) for e, _ in _instances()}
    found = set()
    for mod in pkgutil.walk_packages(vime_core.__path__, "vime_core."):
        if ".vllm_side" in mod.name:  # loaded into the vLLM server only
            continue
        try:
            module = importlib.import_module(mod.name)
        except ImportError:
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__ and "__init__" in vars(cls):
                found.add(cls)
    assert found <= covered, sorted(c.__qualname__ for c in found - covered)
