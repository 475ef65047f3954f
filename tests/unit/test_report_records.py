"""Run records: append/replace semantics, the console line, the reward gain, the curve."""

import pytest

from vime_core.report.curve import reward_curve_png
from vime_core.report.records import append_record, console_line, read_records, recurring_step_s, reward_gain


def test_records_keep_last_per_rollout_id(tmp_path):
    uri = str(tmp_path)
    append_record(uri, "r", {"rollout_id": 0, "reward_mean": 0.1})
    append_record(uri, "r", {"rollout_id": 1, "reward_mean": 0.2})
    append_record(uri, "r", {"rollout_id": 0, "reward_mean": 0.3})  # a retried iteration
    recs = read_records(uri, "r")
    assert [r["rollout_id"] for r in recs] == [0, 1]
    assert recs[0]["reward_mean"] == 0.3


def test_a_local_metrics_file_is_appended_to_not_rewritten(tmp_path):
    """One write of one line per iteration (a whole-file rewrite is quadratic in the run's length):
    the file is the same file (inode) and the earlier bytes are untouched."""
    import os

    path = append_record(str(tmp_path), "r", {"rollout_id": 0, "reward_mean": 0.1})
    inode, before = os.stat(path).st_ino, open(path, "rb").read()
    append_record(str(tmp_path), "r", {"rollout_id": 1, "reward_mean": 0.2})
    after = open(path, "rb").read()
    assert os.stat(path).st_ino == inode and after.startswith(before) and after.count(b"\n") == 2


def test_a_line_cut_short_by_a_killed_writer_is_skipped_and_the_next_record_is_whole(tmp_path):
    path = append_record(str(tmp_path), "r", {"rollout_id": 0, "reward_mean": 0.1})
    with open(path, "a") as f:
        f.write('{"rollout_id": 1, "rewa')  # killed mid-write
    assert [r["rollout_id"] for r in read_records(str(tmp_path), "r")] == [0]
    append_record(str(tmp_path), "r", {"rollout_id": 1, "reward_mean": 0.2})  # the iteration, run again
    assert [(r["rollout_id"], r["reward_mean"]) for r in read_records(str(tmp_path), "r")] == [(0, 0.1), (1, 0.2)]


def test_reward_gain_is_last3_minus_first3():
    recs = [{"rollout_id": i, "reward_mean": i / 10} for i in range(8)]
    first = sum(r["reward_mean"] for r in recs[:3]) / 3
    last = sum(r["reward_mean"] for r in recs[-3:]) / 3
    assert abs(reward_gain(recs) - (last - first)) < 1e-12
    assert reward_gain(recs[:5]) is None


def test_console_line_names_versions_and_phases():
    line = console_line(
        {
            "rollout_id": 7,
            "version_before": 8,
            "version_after": 9,
            "reward_mean": 0.5,
            "response_len_mean": 2.0,
            "t_step": 2.5,
            "t_rollout": 1.0,
        }
    )
    assert "iter   7 v8->v9" in line and "reward 0.500" in line and "rollout 1.00" in line and "sync -" in line


def test_console_line_shows_the_critic_with_one():
    base = {"rollout_id": 3, "clip_fraction": 0.01, "t_step": 1.0}
    assert "clip 0.010 vloss 0.250 ev 0.31 T_step" in console_line(
        {**base, "value_loss": 0.25, "explained_variance": 0.314}
    )
    assert "clip 0.010 vloss 0.250 ev - T_step" in console_line({**base, "value_loss": 0.25})  # constant returns
    assert "vloss" not in console_line(base)


def test_console_line_shows_nan_and_inf_and_the_skipped_steps():
    """A NaN or Inf is shown as such ("-" is for a value the record lacks), and the optimizer steps
    skipped for a non-finite loss or gradient are named when there are any."""
    base = {"rollout_id": 3, "reward_mean": float("nan"), "response_len_mean": float("inf"), "t_step": 1.0}
    line = console_line({**base, "clip_fraction": float("-inf"), "skipped_steps": 2})
    assert "reward nan len inf clip -inf skipped 2 steps T_step" in line
    assert "clip - skipped 1 step (critic 3) vloss" in console_line(
        {**base, "skipped_steps": 1, "critic_skipped_steps": 3, "value_loss": 0.5}
    )
    assert "skipped" not in console_line({**base, "skipped_steps": 0})


def test_console_line_says_when_the_rollout_started_early():
    base = {"rollout_id": 3, "t_rollout": 0.4, "time_total_s": 1.3}
    assert "started early, 1.30 generating" in console_line({**base, "prefetched": 1.0})
    assert "started early" not in console_line(base)


def test_overhead_is_wall_minus_actor_compute_over_the_steady_window():
    from vime_core.report.overhead import compute_seconds, overhead

    computed = [{"time_total_s": 1.0 + i, "time_build_s": 0.1, "train_time_s": 0.5, "publish_s": 0.1} for i in range(6)]
    # persist's write is overhead, as the issue defines it (Prefect + Ray calls + persist)
    records = [{**r, "t_write_s": 0.2, "t_persist": 0.3} for r in computed]
    extra = 0.6  # what each iteration's wall adds to its compute
    walls = [sum(r.values()) + extra for r in computed]
    assert abs(compute_seconds(records[0]) - sum(computed[0].values())) < 1e-12
    split = overhead(walls, records)
    window = range(1, 5)  # first (warm-up) and last (starts no next rollout) left out
    wall = sum(walls[i] for i in window)
    assert split["window"] == len(window)
    assert abs(split["mean_overhead_s"] - extra) < 1e-9
    assert abs(split["fraction"] - len(window) * extra / wall) < 1e-12
    assert overhead([], [])["fraction"] is None


def test_reward_curve_is_a_png():
    png = reward_curve_png([{"rollout_id": i, "reward_mean": i / 4} for i in range(5)], "t")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def test_report_table_artifact_holds_the_latest_iterations_and_the_file_all(tmp_path, monkeypatch):
    import logging

    import tasks.report as report
    from vime_core.config import VimeConfig

    tables = []
    monkeypatch.setattr(report, "get_run_logger", lambda: logging.getLogger("test-report"))
    monkeypatch.setattr(report, "create_table_artifact", lambda **kw: tables.append(kw))
    cfg = VimeConfig(run_name="rep", storage_uri=str(tmp_path))
    n = report.TABLE_ROWS + 5
    for k in range(n):
        report.report_iteration.fn(cfg, k, {"rollout_id": k, "reward_mean": k / n, "t_step": 1.0}, draw_curve=False)
    assert [row["rollout_id"] for row in tables[-1]["table"]] == list(range(n - report.TABLE_ROWS, n))
    assert [r["rollout_id"] for r in read_records(str(tmp_path), "rep")] == list(range(n))
    assert f"{tmp_path}/reports/rep/metrics.jsonl" in tables[-1]["description"]


@pytest.mark.integration  # a fresh interpreter
def test_preload_imports_pyplot_in_the_calling_thread():
    """A fresh interpreter: pyplot is imported when preload returns, and no thread is left
    importing beside the caller (why: the docstring of vime_core.report.curve.preload)."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, threading\n"
        "from vime_core.report.curve import preload\n"
        "assert 'matplotlib.pyplot' not in sys.modules\n"
        "before = set(threading.enumerate())\n"
        "assert preload() is None\n"
        "assert 'matplotlib.pyplot' in sys.modules\n"
        "assert set(threading.enumerate()) <= before, threading.enumerate()\n"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, timeout=120)


def test_the_recurring_step_leaves_out_the_eval_and_checkpoint_that_ran():
    phases = {"t_rollout": 10.0, "t_train": 4.0}
    plain = {"rollout_id": 1, "t_step": 15.0, "t_eval": 0.0, "t_save": 0.0, **phases}
    saving = {"rollout_id": 2, "t_step": 36.0, "t_eval": 1.5, "t_save": 20.0, **phases}
    assert recurring_step_s(plain) == plain["t_step"]
    assert recurring_step_s(saving) == saving["t_step"] - saving["t_eval"] - saving["t_save"]
    assert recurring_step_s({"rollout_id": 0, "t_step": 2.0}) == 2.0  # a record from before the two were kept
    assert recurring_step_s({"rollout_id": 0}) is None
    assert "eval" not in console_line(plain) and "save" not in console_line(plain)
    assert "T_step 36.00s" in console_line(saving) and "eval 1.50 save 20.00]" in console_line(saving)
