"""W&B and TensorBoard tracking (vime_core/report/tracking.py), read back with each tool's own
reader: W&B's offline run folders with `wandb leet inspect --json`, TensorBoard's event files
with its EventAccumulator. No network: W&B runs offline."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from vime_core.config import ConfigError, VimeConfig, make_config
from vime_core.config.loader import dump_config, parse_args
from vime_core.report import tracking
from vime_core.report.tracking import scalars, track

SECRET = "wandb-key-that-must-not-be-written-0123456789"


def _record(k: int, reward: float) -> dict:
    """A record shaped like step_plan.iteration_record's (numbers, bools, strings, a nested dict)."""
    return {
        "rollout_id": k,
        "version_before": k + 1,
        "version_after": k + 2,
        "reward_mean": reward,
        "response_len_mean": 2.0 + k,
        "t_rollout": 0.5,
        "t_train": 0.25 + k,
        "t_step": 1.0 + k,
        "from_store": k % 2 == 1,
        "batch_key": f"batches/run/{k:08d}.parquet",
        "clip_fraction": None,
        "memory": {"engines_after_offload_rollout": {"used": 1000 + k}},
        "weight_check": {"versions": [k]},
    }


def _scalars_by_step(tags: dict[str, list[tuple[int, float]]]) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for tag, points in tags.items():
        for step, value in points:
            out.setdefault(step, {})[tag] = value
    return out


def _tensorboard(folder: Path) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return _scalars_by_step({tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]})


def _wandb_runs(folder: Path) -> list[list[dict]]:
    """The records of each offline run folder under `folder`, oldest first, as W&B's own
    inspector prints them."""
    runs = sorted((folder / "wandb").glob("offline-run-*"))
    out = []
    for run in runs:
        text = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run)],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
        out.append([json.loads(line) for line in text.splitlines() if line.strip()])
    return out


def _report(cfg: VimeConfig, ks, reward, monkeypatch) -> list[str]:
    """Iterations through the real report task body (Prefect's logger and artifacts stubbed);
    returns the warnings it logged."""
    import tasks.report as report

    warned: list[str] = []
    logger = logging.getLogger("test-tracking")
    monkeypatch.setattr(logger, "warning", lambda msg, *a: warned.append(msg % a if a else msg))
    monkeypatch.setattr(report, "get_run_logger", lambda: logger)
    monkeypatch.setattr(report, "create_table_artifact", lambda **kw: None)
    for k in ks:
        report.report_iteration.fn(cfg, k, _record(k, reward(k)), draw_curve=False)
    return warned


def test_scalars_keep_numbers_flatten_dicts_and_leave_out_the_rest():
    import numpy as np

    out = scalars(
        {"a": 1, "b": 0.5, "c": True, "d": None, "e": "x", "f": [1, 2], "g": {"h": {"i": 3}}, "j": np.float32(0.25)}
    )
    assert out == {"a": 1.0, "b": 0.5, "c": 1.0, "g/h/i": 3.0, "j": 0.25}


@pytest.mark.integration  # driver processes and wandb's reader
def test_wandb_and_tensorboard_read_back_and_resume_into_the_same_run(tmp_path, monkeypatch):
    """Two driver processes (the second resumes): steps 0-1, then 2-3. W&B: one run id, the
    resolved configuration, every record's numbers at step = rollout id, nothing twice.
    TensorBoard: the same values at the same steps. The W&B key is written nowhere."""
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    reward = lambda k: 0.1 * (k + 1)  # noqa: E731
    cfg = VimeConfig(
        run_name="track.me",
        storage_uri=str(tmp_path),
        num_rollout=2,
        use_wandb=True,
        wandb_mode="offline",
        wandb_group="g1",
        use_tensorboard=True,
    )
    dump_config(cfg, tmp_path / "reports" / cfg.run_name / "config.json")  # as the train flow does
    assert _report(cfg, [0, 1], reward, monkeypatch) == []
    assert not [key for key in tracking._OPEN if key.endswith(cfg.run_name)]  # the last iteration finished them
    resumed = cfg.model_copy(update={"num_rollout": 4})
    assert _report(resumed, [2, 3], reward, monkeypatch) == []

    folder = tmp_path / "reports" / cfg.run_name
    expected = {k: scalars(_record(k, reward(k))) for k in range(4)}
    assert expected[1]["memory/engines_after_offload_rollout/used"] == 1001.0 and "batch_key" not in expected[1]

    board = _tensorboard(folder / "tensorboard")
    assert sorted(board) == [0, 1, 2, 3]
    for k in range(4):
        assert board[k] == pytest.approx(expected[k], rel=1e-6)  # TensorBoard keeps float32

    runs = _wandb_runs(folder)
    assert len(runs) == 2  # one offline folder per driver process; `wandb sync` joins them
    history = {}
    for records in runs:
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        loc, _ = tracking.report_folder(cfg.storage_uri, cfg.run_name)
        assert run["run_id"] == tracking.wandb_run_id(cfg.run_name, loc.url(f"reports/{cfg.run_name}"))
        assert run["run_id"].startswith("track-me-") and run["project"] == "vime" and run["run_group"] == "g1"
        assert run["display_name"] == cfg.run_name
        config = run["config"]["update"]
        assert config["run_name"] == cfg.run_name and config["use_wandb"] is True and config["lr"] == cfg.lr
        for r in records:
            if r["type"] == "history":
                step = int(r["history"]["step"].get("num", 0))
                assert step not in history, f"step {step} logged twice"
                history[step] = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
    assert sorted(history) == [0, 1, 2, 3]
    for k in range(4):
        assert history[k] == pytest.approx(expected[k])
    assert runs[1][1]["run"]["config"]["update"]["num_rollout"] == 4  # the resumed driver's configuration

    leaked = [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []
    assert (folder / "config.json").is_file() and "wandb" in (folder / "config.json").read_text()


def test_tensorboard_hides_what_a_crashed_driver_logged_after_the_resume_point(tmp_path):
    """The first driver logs 0-2 and dies before finishing; the resumed one runs 2 again (new
    values) and 3: TensorBoard shows each step once, with the values of the last run."""
    cfg = VimeConfig(run_name="tb", storage_uri=str(tmp_path), num_rollout=4, use_tensorboard=True)
    for k in range(3):
        assert track(cfg, _record(k, 0.0), k, last=False) == []
    assert tracking.finish_all() == []  # the driver process ends
    for k in (2, 3):
        assert track(cfg, _record(k, 1.0), k, last=k == 3) == []
    got = _tensorboard(tmp_path / "reports" / "tb" / "tensorboard")
    assert sorted(got) == [0, 1, 2, 3]
    assert [got[k]["reward_mean"] for k in range(4)] == [0.0, 0.0, 1.0, 1.0]
    assert len(list((tmp_path / "reports" / "tb" / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_tensorboard_on_remote_storage_is_copied_there(tmp_path):
    import fsspec

    cfg = VimeConfig(run_name="remote-tb", storage_uri="memory://vime-track-test", num_rollout=2, use_tensorboard=True)
    for k in range(2):
        assert track(cfg, _record(k, 0.5), k, last=k == 1) == []
    fs = fsspec.filesystem("memory")
    files = fs.ls("/vime-track-test/reports/remote-tb/tensorboard", detail=False)
    assert len(files) == 1 and "events.out.tfevents." in files[0]
    local = tmp_path / "copy"
    local.mkdir()
    fs.get_file(files[0], str(local / Path(files[0]).name))
    assert sorted(_tensorboard(local)) == [0, 1]


def test_a_failing_tracker_warns_once_and_the_run_goes_on(tmp_path, monkeypatch):
    """W&B online without a network: its start fails; one warning line, TensorBoard still
    gets every iteration, metrics.jsonl is written."""
    import wandb

    from vime_core.report.records import read_records

    def no_network(**kwargs):
        raise wandb.errors.CommError("Failed to get resume status for run x: context deadline exceeded\nwhile retrying")

    monkeypatch.setattr(wandb, "init", no_network)
    cfg = VimeConfig(
        run_name="offline-net", storage_uri=str(tmp_path), num_rollout=3, use_wandb=True, use_tensorboard=True
    )
    warned = _report(cfg, [0, 1, 2], lambda k: k / 2, monkeypatch)
    assert len(warned) == 1 and "\n" not in warned[0]
    assert warned[0].startswith("wandb tracking failed and is off for this run: CommError: Failed to get resume status")
    assert sorted(_tensorboard(tmp_path / "reports" / "offline-net" / "tensorboard")) == [0, 1, 2]
    assert [r["rollout_id"] for r in read_records(str(tmp_path), "offline-net")] == [0, 1, 2]


@pytest.mark.parametrize("field, value", [("wandb_mode", "ofline"), ("wandb_project", "team/project")])
def test_a_bad_tracking_setting_names_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        make_config({"use_wandb": True, field: value})


def test_a_misspelled_wandb_mode_flag_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--use-wandb", "--wandb-mode", "ofline"])
    assert "--wandb-mode" in capsys.readouterr().err


@pytest.mark.integration  # driver processes and wandb's reader
def test_no_tracking_imports_neither_wandb_nor_tensorboard():
    code = (
        "import sys\n"
        "from vime_core.config import VimeConfig\n"
        "from vime_core.report.tracking import track\n"
        "assert track(VimeConfig(), {'rollout_id': 0}, 0, last=True) == []\n"
        "assert 'wandb' not in sys.modules and 'tensorboard' not in sys.modules, sorted(sys.modules)\n"
    )
    repo = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo, timeout=120)
