"""vime_core/utils/timing.py: the one phase timer (timed, Stopwatch, PhaseClock)."""

import pytest

from vime_core.utils import timing
from vime_core.utils.timing import PhaseClock, Stopwatch, timed


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter that moves only when told: seconds are exact."""
    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def test_timed_writes_the_seconds_under_the_key(clock):
    record = {"other": 1.0}
    with timed("t_train", record) as watch:
        clock[0] += 2.5
    assert record == {"other": 1.0, "t_train": 2.5}
    assert watch.seconds == 2.5


def test_a_phase_timed_twice_sums(clock):
    record = {}
    for step in (1.0, 0.25):
        with timed("transfer", record):
            clock[0] += step
    assert record == {"transfer": 1.25}


def test_a_failing_block_still_records_and_the_error_propagates(clock):
    record = {}
    with pytest.raises(ValueError, match="boom"):
        with timed("t_sync", record):
            clock[0] += 3.0
            raise ValueError("boom")
    assert record == {"t_sync": 3.0}


def test_without_a_record_the_value_is_read_from_the_watch_and_frozen(clock):
    with timed() as watch:
        clock[0] += 4.0
    clock[0] += 10.0  # after the block: the reading does not move
    assert watch.seconds == 4.0


def test_a_record_without_a_key_is_refused():
    with pytest.raises(TypeError, match="a record needs a key"):
        with timed(None, {}):
            pass


def test_stopwatch_marks_while_running_and_freezes_on_stop(clock):
    since = Stopwatch()
    clock[0] += 1.0
    assert since.seconds == 1.0  # a mark: still running
    clock[0] += 1.0
    assert since.stop() == 2.0
    clock[0] += 5.0
    assert since.stop() == 2.0 and since.seconds == 2.0


def test_phase_clock_keeps_publish_weights_shape(clock):
    """publish_weights' record: seconds per phase, summed, and the total since the clock was made."""
    phases = PhaseClock()
    clock[0] += 0.5  # before any phase: counts in total only
    with phases("gather"):
        clock[0] += 1.0
    with phases("transfer"):
        clock[0] += 2.0
    with phases("transfer"):
        clock[0] += 1.0
    assert phases.seconds == {"gather": 1.0, "transfer": 3.0}
    assert phases.total() == 4.5
