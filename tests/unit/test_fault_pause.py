"""The fault tests' pause points (vime_core/faults.PausePoints): off unless asked for; a paused
driver announces itself with its pid and goes on only once the file is gone."""

from __future__ import annotations

import os
import threading

import pytest

from vime_core.faults import PAUSE_AT_ENV, PAUSE_DIR_ENV, pause_points


def test_unset_means_no_pause_points_and_no_hook():
    import tasks.common

    assert pause_points({}) is None
    if PAUSE_AT_ENV not in os.environ:
        assert "on_running" not in tasks.common.TASK_DEFAULTS


def test_pause_points_need_a_directory():
    with pytest.raises(ValueError, match=PAUSE_DIR_ENV):
        pause_points({PAUSE_AT_ENV: "train-3"})


def test_a_named_task_run_pauses_once_until_its_file_is_removed(tmp_path):
    points = pause_points({PAUSE_AT_ENV: " train-3 , sync-v6", PAUSE_DIR_ENV: str(tmp_path)})
    assert points.names == {"train-3", "sync-v6"}
    points.pause("train-2")  # not named: returns at once
    assert list(tmp_path.iterdir()) == []

    paused = threading.Thread(target=points.pause, args=("train-3",))
    paused.start()
    announced = tmp_path / "train-3"
    while not announced.exists():
        assert paused.is_alive()
        paused.join(0.01)
    assert announced.read_text() == str(os.getpid())
    paused.join(0.2)
    assert paused.is_alive()  # still waiting: the file is there
    announced.unlink()
    paused.join(10)
    assert not paused.is_alive()

    points.pause("train-3")  # the second time (a retry of the task run): no pause
    assert not announced.exists()
