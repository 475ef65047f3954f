"""What kind of failure ended an iteration, and whether running it again can help.

The train flow retries an iteration only when the infrastructure failed (a process that died or
could not be reached comes back, so a second try can succeed). A configuration or data error fails
the same way every time: retrying only hides it, so the run stops and says what to fix."""

from __future__ import annotations

import functools
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from vime_core.cluster.errors import ActorsMissingError
from vime_core.utils.errors import (
    InfrastructureError,
    PartiallyTrainedError,
    StaleEnginesError,
    TrainerOutOfMemoryError,
    first_line,
)

INFRASTRUCTURE = "infrastructure"
CONFIGURATION = "configuration or data"
DEVICE_MEMORY = "device memory"
UNKNOWN = "unknown"

# Ray's message for a dead actor carries its name on a line "name: trainer-0".
_ACTOR_NAME = re.compile(r"^\s*name:\s*(\S+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Fault:
    """A classified failure: `kind` (see classify), whether a retry can help, and one line
    saying what happened (no traceback)."""

    kind: str
    retryable: bool
    what: str
    error_type: str


@functools.cache
def _infrastructure_types() -> tuple[type, ...]:
    """Built once (classify runs for every failed task's log record): vime's own classes carry
    the InfrastructureError marker; Ray's, httpx's and botocore's are imported lazily, since they
    are not needed to import this module."""
    import ray.exceptions as rx

    types = [
        rx.RayActorError,
        rx.WorkerCrashedError,
        rx.NodeDiedError,
        rx.ObjectLostError,
        rx.ObjectFetchTimedOutError,
        rx.RaySystemError,
        rx.GetTimeoutError,
        ConnectionError,
        TimeoutError,
        InfrastructureError,
    ]
    try:
        import httpx

        types.append(httpx.TransportError)
    except ImportError:  # the engine client is not installed: no HTTP errors to expect
        pass
    try:  # an S3 store that did not answer; the ConnectionRefusedError beneath it is lost when
        # the error crosses Ray (its __context__ is not pickled), so the botocore class decides
        import botocore.exceptions as bx

        types += [bx.ConnectionError, bx.HTTPClientError]
    except ImportError:  # no s3fs: local storage only
        pass
    return tuple(types)


def _collective_types() -> tuple[type, ...]:
    """torch.distributed's errors of a lost peer, store or network (NCCL's and Gloo's
    DistBackendError, the TCPStore's DistStoreError, DistNetworkError): the group is rebuilt and the
    iteration runs again. Looked up only where torch.distributed is already imported, as it is in
    any process that raised or unpickled one (the driver imports no torch to classify)."""
    dist = sys.modules.get("torch.distributed")
    names = ("DistBackendError", "DistStoreError", "DistNetworkError")
    return tuple(getattr(dist, n) for n in names if hasattr(dist, n)) if dist is not None else ()


# NCCL's own verdict that the caller misused it (ncclInvalidUsage, ncclInvalidArgument: mismatched
# shapes, dtypes or group members across ranks): the same code raises it again after a rebuild
_COLLECTIVE_MISUSE = ("ncclInvalidUsage", "ncclInvalidArgument", "invalid usage", "invalid argument")


def _collective_misuse(err: BaseException, collective: tuple[type, ...]) -> bool:
    """A torch.distributed error whose message is NCCL's misuse verdict: a bug, not a lost peer."""
    return isinstance(err, collective) and any(m in str(err) for m in _COLLECTIVE_MISUSE)


_CONFIGURATION_TYPES = (
    ValueError,
    TypeError,
    LookupError,
    ImportError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
)


def _unwrap(exc: BaseException) -> BaseException:
    """What the remote code raised, for an exception that crossed Ray as RayTaskError, or that
    an actor's constructor raised (ActorDiedError of a failed creation task)."""
    from ray.exceptions import RayActorError, RayTaskError

    while True:
        if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
            exc = exc.cause
        elif (
            isinstance(exc, RayActorError)
            and getattr(exc, "actor_init_failed", False)
            and exc.args
            and isinstance(exc.args[0], RayTaskError)
        ):
            exc = exc.args[0]
        else:
            return exc


def _chain(exc: BaseException):
    """The exception, then what it was raised from or while handling, outermost first."""
    seen: set[int] = set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield _unwrap(current)
        current = current.__cause__ or current.__context__


def classify(exc: BaseException) -> Fault:
    """The Fault of `exc`: its kind and whether a retry can help.

        infrastructure (retried)   Ray's RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError
                                   (and subclasses), ObjectFetchTimedOutError, RaySystemError, GetTimeoutError;
                                   ConnectionError, TimeoutError, httpx.TransportError, botocore's
                                   ConnectionError and HTTPClientError; torch.distributed's
                                   DistBackendError, DistStoreError, DistNetworkError (a collective
                                   or its store lost a peer; not NCCL's ncclInvalidUsage or
                                   ncclInvalidArgument, a misuse that a rebuild raises again: a bug);
                                   vime's InfrastructureError subclasses
                                   (RolloutFailedError, EngineStartError, EngineError, RouterError,
                                   PublishError, ActorsMissingError)
        configuration or data      ValueError (ConfigError, ValidationError, UntrainableBatchError,
          (not retried)            SchemaError, CheckpointError, HookLoadError, RewardFailureError,
                                   FilterExhaustedError, NonFiniteStepsError), TypeError, KeyError,
                                   LookupError, ImportError, FileNotFoundError, NotADirectoryError,
                                   PermissionError
        device memory              TrainerOutOfMemoryError: a trainer call ran out of device memory;
          (not retried)            the same step runs out again; its message names the settings
        anything else              most likely a bug (not retried)

    An exception raised in a Ray task or actor arrives as RayTaskError: its `cause` decides; an actor
    whose constructor raised arrives as ActorDiedError carrying that RayTaskError, which decides (a
    setting that kept the engines from starting is a configuration error, not a crash). A chain
    (`raise ... from`, or raised while handling another) is searched outermost first."""
    collective = _collective_types()
    infrastructure = _infrastructure_types() + collective
    for err in _chain(exc):
        if _collective_misuse(err, collective):
            break
        # infrastructure first: a dead actor's error must not read as a data error because some
        # wrapper subclasses ValueError (RayTaskError takes on the class of its cause)
        if isinstance(err, infrastructure):
            return Fault(INFRASTRUCTURE, True, describe(err), type(err).__name__)
        if isinstance(err, PartiallyTrainedError):  # judged by what failed; the refusal, by a rebuild
            inner = classify(err.failure) if err.failure is not None else None
            kind, retryable = (inner.kind, inner.retryable) if inner is not None else (INFRASTRUCTURE, True)
            return Fault(kind, retryable, describe(err), type(err).__name__)
        if isinstance(err, TrainerOutOfMemoryError):
            return Fault(DEVICE_MEMORY, False, str(err), type(err).__name__)  # one line, settings first
        if isinstance(err, _CONFIGURATION_TYPES):
            return Fault(CONFIGURATION, False, describe(err), type(err).__name__)
    err = _unwrap(exc)
    return Fault(UNKNOWN, False, describe(err), type(err).__name__)


def needs_bootstrap(exc: BaseException) -> bool:
    """Only bootstrap, before the iteration's retry, helps: the failed call's actor died or is
    gone (actor_died), or holds steps of a rollout whose training failed half-way
    (PartiallyTrainedError: bootstrap rebuilds it), or engines hold weights a publish did not
    reach (StaleEnginesError: bootstrap publishes again). A phase task does not call it again."""
    return actor_died(exc) or raised_in_chain(exc, (PartiallyTrainedError, StaleEnginesError))


def raised_in_chain(exc: BaseException, types: tuple[type[BaseException], ...]) -> bool:
    """`exc`, or an exception in its chain (what it was raised from or while handling, and what
    remote code raised under a RayTaskError), is one of `types`. Whether the process was told
    to stop is this with Prefect's signals among `types` (tasks/signals.py: this library does
    not import Prefect)."""
    return any(isinstance(err, types) for err in _chain(exc))


def left_engines_half_published(exc: BaseException) -> bool:
    """A publish in `exc`'s chain failed after its first byte reached the engines
    (`PublishError.bytes_moved`, read by name: the driver does not import the publisher): they may
    hold part of it under the version they report."""
    return any(getattr(err, "bytes_moved", False) is True for err in _chain(exc))


def actor_died(exc: BaseException) -> bool:
    """The failed call's own actor is dead (ActorDiedError) or gone (ActorsMissingError): only
    rebuilding it helps, so a phase task does not try it again and the iteration's retry
    (bootstrap first) comes at once. An actor that is only unreachable for now
    (ActorUnavailableError) is not dead."""
    from ray.exceptions import ActorDiedError

    return isinstance(exc, (ActorDiedError, ActorsMissingError))


def describe(err: BaseException) -> str:
    """One line: `trainer-0 died` for a dead actor, else the message's first line."""
    from ray.exceptions import RayActorError

    if isinstance(err, RayActorError):
        name = _ACTOR_NAME.search(str(err))
        return f"{name.group(1) if name else 'an actor'} died"
    if getattr(err, "missing", None):  # ActorsMissingError: a retried task found the actor gone
        return f"{', '.join(err.missing)} gone (its process died)"
    return first_line(err)


def retry_delay(base_s: float, attempt: int) -> float:
    """Seconds before attempt `attempt` (2, 3, ...): `base_s`, then doubled for each further try."""
    return base_s * 2 ** max(0, attempt - 2)


# The fault tests' handle on a driver, off unless set (tasks/common.py reads it once, at import):
# the driver pauses as each named phase task run starts, so a test kills a process in a known
# phase instead of after a guessed sleep.
PAUSE_AT_ENV = "VIME_FAULT_PAUSE_AT"  # task run names, comma-separated: "persist-6,sync-v9"
PAUSE_DIR_ENV = "VIME_FAULT_PAUSE_DIR"  # where the paused driver announces itself


@dataclass
class PausePoints:
    """On reaching a named task run (the first time in this process), write `directory/<name>`
    holding the driver's pid and wait while that file exists: the test does its harm (kills the
    driver, an actor, a server) and deletes the file to let the driver go on."""

    names: frozenset[str]
    directory: str
    poll_s: float = 0.05
    reached: set[str] = field(default_factory=set)

    def pause(self, name: str) -> None:
        if name not in self.names or name in self.reached:
            return
        self.reached.add(name)
        path = os.path.join(self.directory, name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, path)  # appears whole: the test reads the pid as soon as it sees the file
        while os.path.exists(path):
            time.sleep(self.poll_s)


def pause_points(environ: Mapping[str, str] = os.environ) -> Optional[PausePoints]:
    """The pause points `environ` asks for (PAUSE_AT_ENV, PAUSE_DIR_ENV), or None (the default)."""
    names = frozenset(n.strip() for n in environ.get(PAUSE_AT_ENV, "").split(",") if n.strip())
    if not names:
        return None
    directory = environ.get(PAUSE_DIR_ENV)
    if not directory:
        raise ValueError(f"{PAUSE_AT_ENV} is set but {PAUSE_DIR_ENV} (where to announce a pause) is not")
    return PausePoints(names, directory)
