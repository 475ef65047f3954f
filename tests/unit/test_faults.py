"""Which failures the train flow retries (vime_core/faults.py), and its retry loop
(flows.train.run_iterations) with the iteration flow and bootstrap replaced by fakes."""

from __future__ import annotations

import logging

import pytest

from vime_core.faults import CONFIGURATION, INFRASTRUCTURE, UNKNOWN, classify, retry_delay


def _remote(cause: BaseException):
    """How an exception raised inside a Ray actor reaches the caller."""
    from ray.exceptions import RayTaskError

    return RayTaskError("train", "Traceback (most recent call last):\n  ...", cause).as_instanceof_cause()


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionResetError("connection reset by peer"),
        TimeoutError("read timed out"),
    ],
)
def test_connection_errors_are_infrastructure(exc):
    fault = classify(exc)
    assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True)


def test_a_dead_actor_is_named():
    from ray.exceptions import ActorDiedError

    fault = classify(ActorDiedError())
    assert fault.kind == INFRASTRUCTURE and fault.retryable and fault.error_type == "ActorDiedError"
    assert fault.what == "an actor died"  # Ray's message names the actor: "trainer-0 died"


def test_rollout_and_engine_failures_raised_in_an_actor_are_infrastructure():
    from vime_core.engines.server import EngineStartError
    from vime_core.rollout.loop import RolloutFailedError

    for cause in (
        RolloutFailedError("no engine answered /health within 600 s (engines: e0)"),
        EngineStartError("server did not become healthy"),
    ):
        fault = classify(_remote(cause))
        assert (fault.kind, fault.retryable, fault.error_type) == (INFRASTRUCTURE, True, type(cause).__name__)
        assert "\n" not in fault.what and "Traceback" not in fault.what


def _died_in_init(cause: BaseException):
    """The ActorDiedError of an actor whose constructor raised `cause`."""
    from ray.exceptions import ActorDiedError, RayTaskError

    return ActorDiedError(RayTaskError("__init__", "Traceback ...", _remote(cause)))


def test_an_actor_whose_constructor_raised_is_judged_by_what_it_raised():
    """ActorDiedError of a failed creation task carries the constructor's error: a RolloutManager
    whose engine refused its memory setting is a setting to fix, one whose engine crashed at start
    is infrastructure."""
    from vime_core.engines.server import DeviceMemoryError, EngineStartError

    refused = classify(_died_in_init(DeviceMemoryError("engine-0: vllm_gpu_memory_utilization=0.9 asks for 90%")))
    assert (refused.kind, refused.retryable, refused.error_type) == (CONFIGURATION, False, "DeviceMemoryError")
    assert refused.what == "engine-0: vllm_gpu_memory_utilization=0.9 asks for 90%"
    crashed = classify(_died_in_init(EngineStartError("engine-0: vLLM server exited with code 1")))
    assert (crashed.kind, crashed.error_type) == (INFRASTRUCTURE, "EngineStartError")


def test_prefect_retries_a_task_unless_the_error_is_configuration_or_data():
    from types import SimpleNamespace

    from tasks.common import retry_unless_configuration
    from vime_core.data.validation import UntrainableBatchError

    def retried(exc):
        return retry_unless_configuration(None, None, SimpleNamespace(data=exc))

    assert retried(ConnectionResetError("reset")) and retried(RuntimeError("a bug, maybe flaky"))
    assert not retried(UntrainableBatchError("sample 0: response_length=0 must be >= 1"))
    assert retried(None)  # a failed state without an exception: Prefect's default


def test_missing_actors_are_infrastructure():
    from vime_core.cluster.errors import ActorsMissingError

    fault = classify(ActorsMissingError("run 'x' has no trainer-0 in namespace vime-x ...", ("trainer-0",)))
    assert fault.retryable and fault.what == "trainer-0 gone (its process died)"


def test_configuration_and_data_errors_are_not_retried():
    from vime_core.config import VimeConfig
    from vime_core.data.validation import UntrainableBatchError

    try:
        VimeConfig(num_rollout=0)
    except Exception as exc:  # pydantic's ValidationError is a ValueError
        config_error = exc
    for exc in (config_error, _remote(UntrainableBatchError("sample 0: response_length=0 must be >= 1"))):
        fault = classify(exc)
        assert (fault.kind, fault.retryable) == (CONFIGURATION, False)
    assert classify(_remote(UntrainableBatchError("sample 0: response_length=0"))).what == "sample 0: response_length=0"


def test_an_infrastructure_cause_decides_over_its_wrapper():
    """A task that failed on a dead actor and re-raised it as something else."""
    from ray.exceptions import WorkerCrashedError

    try:
        try:
            raise WorkerCrashedError()
        except WorkerCrashedError as inner:
            raise RuntimeError("train-3 failed") from inner
    except RuntimeError as exc:
        fault = classify(exc)
    assert fault.kind == INFRASTRUCTURE and fault.error_type == "WorkerCrashedError"


def test_anything_else_is_not_retried():
    fault = classify(RuntimeError("assertion in the loss"))
    assert (fault.kind, fault.retryable, fault.what) == (UNKNOWN, False, "assertion in the loss")


def test_back_off_doubles():
    assert [retry_delay(5.0, a) for a in (2, 3, 4)] == [5.0, 10.0, 20.0]


# ---- the train flow's retry loop --------------------------------------------------------------


class _Log:
    def __init__(self):
        self.lines: list[tuple[int, str]] = []

    def _add(self, level, msg, *args, **kwargs):
        self.lines.append((level, msg % args))

    def debug(self, msg, *args, **kwargs):
        self._add(logging.DEBUG, msg, *args)

    def warning(self, msg, *args, **kwargs):
        self._add(logging.WARNING, msg, *args)

    def error(self, msg, *args, **kwargs):
        self._add(logging.ERROR, msg, *args)


@pytest.fixture
def loop(monkeypatch):
    """flows.train with its iteration flow, bootstrap, logger and sleep replaced: returns
    (config, calls, fail_plan, log, sleeps). fail_plan maps (rollout_id, attempt) to the
    exception that attempt raises; bootstrap reports `next_rollout_id` = boot['next']."""
    import flows.train as train_flow
    from vime_core.config import VimeConfig

    cfg = VimeConfig(num_rollout=6, iteration_retries=2, iteration_retry_delay_s=3.0)
    calls: list[int] = []
    fail_plan: dict[tuple[int, int], BaseException] = {}
    boot = {"next": 0, "calls": 0}
    log, sleeps = _Log(), []

    def iteration(config, rollout_id):
        calls.append(rollout_id)
        exc = fail_plan.get((rollout_id, calls.count(rollout_id)))
        if exc is not None:
            raise exc
        return {}

    def bootstrap(config):
        boot["calls"] += 1
        return {"next_rollout_id": boot["next"]}

    monkeypatch.setattr(train_flow, "iteration", iteration)
    monkeypatch.setattr(train_flow, "bootstrap", bootstrap)
    monkeypatch.setattr(train_flow, "get_run_logger", lambda: log)
    monkeypatch.setattr(train_flow.time, "sleep", sleeps.append)
    return cfg, calls, fail_plan, boot, log, sleeps


def test_infrastructure_failure_is_retried_with_back_off_in_one_line(loop):
    from ray.exceptions import ActorDiedError

    import flows.train as train_flow

    cfg, calls, fail_plan, boot, log, sleeps = loop
    fail_plan[(3, 1)] = fail_plan[(3, 2)] = ActorDiedError()
    boot["next"] = 4  # the trainer lived and trained 3: the retry runs iteration 3 again
    walls, failures = train_flow.run_iterations(cfg, 0)
    assert calls == [0, 1, 2, 3, 3, 3, 4, 5] and failures == {3: 2} and len(walls) == 6
    assert sleeps == [3.0, 6.0] and boot["calls"] == 2
    warnings = [m for lvl, m in log.lines if lvl == logging.WARNING]
    assert (
        warnings[0].startswith("iteration 3 failed: ")
        and "(ActorDiedError); retrying in 3 s (attempt 2 of 3)" in warnings[0]
    )
    assert "retrying in 6 s (attempt 3 of 3)" in warnings[1]
    assert all("\n" not in m for m in warnings)


def test_a_rebuilt_trainer_retrains_the_stored_batches_since_its_checkpoint(loop):
    from ray.exceptions import ActorDiedError

    import flows.train as train_flow

    cfg, calls, fail_plan, boot, log, _ = loop
    fail_plan[(4, 1)] = ActorDiedError()
    boot["next"] = 2  # the new trainer restored the checkpoint of rollout 1
    train_flow.run_iterations(cfg, 0)
    assert calls == [0, 1, 2, 3, 4, 2, 3, 4, 5]
    assert any("rollouts 2-3 again, then iteration 4" in m for _, m in log.lines)


def test_gives_up_after_the_configured_attempts(loop):
    import flows.train as train_flow

    cfg, calls, fail_plan, boot, _, _ = loop
    boot["next"] = 2  # the trainer lived: the loop goes on at the failed iteration
    for attempt in (1, 2, 3):
        fail_plan[(2, attempt)] = ConnectionRefusedError("router refused")
    with pytest.raises(
        train_flow.IterationFailedError,
        match=r"iteration 2 failed: router refused \(ConnectionRefusedError\); giving up after 3 attempts",
    ):
        train_flow.run_iterations(cfg, 0)
    assert calls == [0, 1, 2, 2, 2]


def test_a_data_error_is_not_retried_and_says_what_to_fix(loop):
    import flows.train as train_flow
    from vime_core.data.validation import UntrainableBatchError

    cfg, calls, fail_plan, boot, log, sleeps = loop
    fail_plan[(1, 1)] = _remote(UntrainableBatchError("sample 0: response_length=0 must be >= 1"))
    with pytest.raises(train_flow.IterationFailedError) as info:
        train_flow.run_iterations(cfg, 0)
    assert calls == [0, 1] and sleeps == [] and boot["calls"] == 0
    message = str(info.value)
    assert message.startswith("iteration 1 failed: sample 0: response_length=0 must be >= 1 (UntrainableBatchError)")
    assert "configuration or data error, not retried; fix it" in message and "\n" not in message


def test_prefect_logs_known_failures_without_their_traceback():
    """A retried or explained failure: one line; a bug keeps its traceback; debug keeps all."""
    from ray.exceptions import ActorDiedError

    from flows.console import KnownFailureWithoutTraceback

    def record(exc, level=logging.ERROR):
        try:
            raise exc
        except Exception:
            import sys

            return logging.LogRecord("prefect.task_runs", level, __file__, 1, "failed", None, sys.exc_info())

    quiet = KnownFailureWithoutTraceback()
    for exc, keeps in ((ActorDiedError(), False), (ValueError("lr must be > 0"), False), (RuntimeError("bug"), True)):
        r = record(exc)
        assert quiet.filter(r) and (r.exc_info is not None) == keeps, exc
    debug = record(ActorDiedError(), logging.DEBUG)
    assert quiet.filter(debug) and debug.exc_info is not None


def test_vime_train_ends_a_run_it_gives_up_on_with_one_line_and_exit_code_1(monkeypatch, capsys):
    import signal

    import flows.train as train_flow
    from flows import cli

    def fails(cfg):
        raise train_flow.IterationFailedError("iteration 3 failed: trainer-0 died (ActorDiedError); giving up")

    monkeypatch.setattr(train_flow, "train", fails)
    handler = signal.getsignal(signal.SIGINT)
    try:
        rc = cli.cmd_train(["--run-name", "gave-up", "--no-early-start"])  # the early start is not what this checks
    finally:
        signal.signal(signal.SIGINT, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert err == ["[vime] run 'gave-up' stopped: iteration 3 failed: trainer-0 died (ActorDiedError); giving up"]


def test_a_known_failure_is_logged_in_one_line_without_the_remote_traceback():
    from flows.console import KnownFailureWithoutTraceback
    from vime_core.engines.server import DeviceMemoryError

    err = DeviceMemoryError("engine-0: vllm_gpu_memory_utilization=0.9 asks for 90% of each device")
    record = logging.LogRecord(
        "prefect.task_runs",
        logging.ERROR,
        __file__,
        1,
        "Task run failed with exception: %r - Retries are exhausted",
        (RuntimeError("ActorDiedError('Traceback (most recent call last):\n  File ...')"),),
        (type(err), err, None),
    )
    assert KnownFailureWithoutTraceback().filter(record)
    assert record.exc_info is None
    assert record.getMessage().startswith("Task run failed with exception: RuntimeError(\"ActorDiedError('")
    assert "File" not in record.getMessage() and record.getMessage().endswith("(traceback in the debug log)")


def test_a_run_that_cannot_start_for_a_setting_says_so_in_one_line(monkeypatch):
    import flows.train as train_flow
    from vime_core.engines.server import DeviceMemoryError

    lines = []
    log = logging.getLogger("test-start-failed")
    monkeypatch.setattr(log, "error", lambda msg, *a: lines.append(msg % a if a else msg))
    monkeypatch.setattr(train_flow, "get_run_logger", lambda: log)
    err = train_flow.start_failed(_remote(DeviceMemoryError("engine-0: vllm_gpu_memory_utilization=0.9 asks for more")))
    assert isinstance(err, train_flow.RunStoppedError)
    assert (
        lines
        == [str(err)]
        == [
            "the run could not start: engine-0: vllm_gpu_memory_utilization=0.9 asks for more (DeviceMemoryError); "
            "a configuration or data error; fix it and run the same command again"
        ]
    )


def test_an_unreachable_object_store_is_infrastructure():
    """s3fs raises botocore's EndpointConnectionError when the S3 server is down; crossing Ray
    drops the ConnectionRefusedError beneath it (__context__ is not pickled), so botocore's own
    class must decide. A read timeout (HTTPClientError) is infrastructure too."""
    import botocore.exceptions as bx
    import ray.cloudpickle as cloudpickle

    try:
        try:
            raise ConnectionRefusedError(111, "Connect call failed")
        except ConnectionRefusedError:
            raise bx.EndpointConnectionError(endpoint_url="http://127.0.0.1:8333/vime/runs") from None
    except bx.EndpointConnectionError as exc:
        down = cloudpickle.loads(cloudpickle.dumps(exc))  # as a Ray task's error carries it
    assert down.__context__ is None and down.__cause__ is None
    for exc in (down, _remote(down), bx.ReadTimeoutError(endpoint_url="http://127.0.0.1:8333/vime")):
        fault = classify(exc)
        assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True), exc
        assert "\n" not in fault.what
    assert classify(down).what == 'Could not connect to the endpoint URL: "http://127.0.0.1:8333/vime/runs"'


def test_a_collective_that_lost_a_peer_is_infrastructure_and_other_runtime_errors_are_not():
    """torch.distributed's errors of a lost peer, store or network are retried (the iteration's
    retry rebuilds the group), as raised, as a Ray task's error carries them, and as the failure of
    a rollout trained half-way; any other RuntimeError stays a bug."""
    import ray.cloudpickle as cloudpickle
    import torch.distributed as dist

    from vime_core.utils.errors import PartiallyTrainedError

    for cls in (dist.DistBackendError, dist.DistStoreError, dist.DistNetworkError):
        err = cloudpickle.loads(cloudpickle.dumps(cls("NCCL communicator was aborted on rank 1")))
        half = PartiallyTrainedError("rollout 2: 1 optimizer step(s) were applied before training failed", err)
        for exc in (err, _remote(err), _remote(cloudpickle.loads(cloudpickle.dumps(half)))):
            fault = classify(exc)
            assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True), exc
    for exc in (RuntimeError("shape mismatch"), _remote(RuntimeError("shape mismatch"))):
        assert (classify(exc).kind, classify(exc).retryable) == (UNKNOWN, False)


def test_nccl_misuse_is_a_bug_and_not_retried():
    """NCCL's verdict that the caller misused it (mismatched shapes or members across ranks) comes
    as a DistBackendError too; a rebuilt group raises it again, so it is not retried, as raised, as
    a Ray task carries it and under a rollout trained half-way. A remote peer's error stays retried."""
    import ray.cloudpickle as cloudpickle
    import torch.distributed as dist

    from vime_core.utils.errors import PartiallyTrainedError

    misuse = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage (run with NCCL_DEBUG=WARN for details), "
        "NCCL version 2.27.5\nncclInvalidUsage: This usually reflects invalid usage of NCCL library."
    )
    lost = dist.DistBackendError(
        "NCCL error in: ProcessGroupNCCL.cpp:3356, remote process exited or there was a network error\n"
        "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely."
    )
    for err, expected in ((misuse, (UNKNOWN, False)), (lost, (INFRASTRUCTURE, True))):
        err = cloudpickle.loads(cloudpickle.dumps(err))
        half = PartiallyTrainedError("rollout 2: 1 optimizer step(s) were applied before training failed", err)
        for exc in (err, _remote(err), _remote(cloudpickle.loads(cloudpickle.dumps(half)))):
            fault = classify(exc)
            assert (fault.kind, fault.retryable) == expected, exc
            assert "\n" not in fault.what


def test_bootstrap_retries_an_actor_that_died_and_phase_tasks_do_not():
    """A RolloutManager whose engine crashed at start dies in its constructor: bootstrap's next try
    creates it again (on a GPU the crash can be a trainer growing while vLLM profiled its memory),
    a phase task cannot. A setting the engine refused stays a configuration error for both."""
    from types import SimpleNamespace

    from tasks.bootstrap import bootstrap
    from tasks.common import retry_rebuilding_actors, retry_unless_configuration
    from vime_core.engines.server import DeviceMemoryError, EngineStartError

    def died_in_init(cause):
        return SimpleNamespace(data=_died_in_init(cause))

    crashed = died_in_init(EngineStartError("engine-0: vLLM server exited with code 1 before becoming healthy"))
    refused = died_in_init(DeviceMemoryError("engine-0: vllm_gpu_memory_utilization=0.9 asks for 90%"))
    assert retry_rebuilding_actors(None, None, crashed)
    assert not retry_unless_configuration(None, None, crashed)
    assert not retry_rebuilding_actors(None, None, refused)
    assert retry_rebuilding_actors(None, None, SimpleNamespace(data=ConnectionResetError("reset")))
    assert bootstrap.retry_condition_fn is retry_rebuilding_actors and bootstrap.retries == 1
