"""The shared retry/poll policy (vime_core/utils/retry.py) and the index's consistent read built
on it: attempt counts, the back-off schedule, which failures are retried, what propagates."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.storage.fs import open_location
from vime_core.storage.index import _READ_ATTEMPTS, INDEX_SCHEMA, BatchIndex
from vime_core.utils.retry import async_attempts, attempts, poll_until

pytestmark = pytest.mark.timeout(60)


class Flaky:
    """Raises `errors` one by one, then returns `value`; counts calls."""

    def __init__(self, errors, value="done"):
        self.errors, self.value, self.calls = list(errors), value, 0

    def __call__(self, *args):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return self.value


def expected_waits(first_s, max_s, n_waits):
    return [min(first_s * 2 ** (n - 1), max_s) for n in range(1, n_waits + 1)]


def test_async_attempts_back_off_and_reraise_the_last_error():
    first_s, max_s, max_attempts = 0.5, 5.0, 8
    errors = [ConnectionError(f"try {i}") for i in range(max_attempts)]
    flaky, slept, announced = Flaky(errors[:]), [], []

    async def fake_sleep(seconds):
        slept.append(seconds)

    async def call():
        return flaky()

    retrying = async_attempts(
        max_attempts, first_s, max_s, on_retry=lambda state: announced.append(state.upcoming_sleep)
    )
    retrying.sleep = fake_sleep  # the schedule, without waiting it out
    with pytest.raises(ConnectionError) as info:
        asyncio.run(retrying(call))
    assert info.value is errors[-1] and flaky.calls == max_attempts
    assert slept == announced == expected_waits(first_s, max_s, max_attempts - 1)


def test_attempts_stop_at_the_first_success_and_skip_what_is_not_retryable():
    flaky = Flaky([TimeoutError(), TimeoutError()])
    retrying = attempts(5, first_s=0.0)
    assert retrying(flaky) == "done" and flaky.calls == 3

    flaky = Flaky([ValueError("bad request"), TimeoutError()])
    with pytest.raises(ValueError, match="bad request"):
        attempts(5, retry_on=lambda exc: isinstance(exc, TimeoutError))(flaky)
    assert flaky.calls == 1
    with pytest.raises(ValueError, match="at least 1"):
        attempts(0)


def test_poll_until_ready_deadline_and_abort():
    ready_after = 3
    calls = []
    assert poll_until(lambda: calls.append(1) or len(calls) >= ready_after, timeout_s=30, interval_s=0.0) is True
    assert len(calls) == ready_after

    never = []
    assert poll_until(lambda: never.append(1) and False, timeout_s=0.05, interval_s=0.01) is False
    assert len(never) >= 1

    gone = Flaky([RuntimeError("process exited")])
    with pytest.raises(RuntimeError, match="process exited"):
        poll_until(gone, timeout_s=30, interval_s=0.0)
    assert gone.calls == 1


@pytest.mark.parametrize("read", ["snapshot", "entry"])
def test_index_reads_again_while_files_vanish_then_gives_up(tmp_path, read):
    index = BatchIndex(open_location(str(tmp_path)))
    vanishing = _READ_ATTEMPTS - 1
    index._read = Flaky([FileNotFoundError("compacted away")] * vanishing, INDEX_SCHEMA.empty_table())
    result = index.snapshot()[1] if read == "snapshot" else index.entry("run", 0)
    assert index._read.calls == vanishing + 1
    assert (result.num_rows == 0) if read == "snapshot" else (result is None)

    index._read = Flaky([FileNotFoundError("compacted away")] * _READ_ATTEMPTS, INDEX_SCHEMA.empty_table())
    with pytest.raises(RuntimeError, match=f"kept changing during {_READ_ATTEMPTS} reads"):
        index.snapshot() if read == "snapshot" else index.entry("run", 0)
    assert index._read.calls == _READ_ATTEMPTS
