"""Experiment tracking: each iteration's record (the one appended to metrics.jsonl) also goes to
Weights & Biases (`--use-wandb`) and/or TensorBoard (`--use-tensorboard`), step = rollout id. A
tracker that fails is turned off with one warning and the run goes on; the W&B key is wandb's own
(WANDB_API_KEY or `wandb login`), never a configuration field."""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import tempfile
import threading
import time
from typing import Any, Protocol

from vime_core.config.loader import config_dict
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.fs import open_location

# Trackers stay open across the iteration flow runs of one driver process: opening a W&B run
# takes a while and starts W&B's service, and each TensorBoard writer opens a new event file.
_OPEN: dict[str, "Tracking"] = {}
_LOCK = threading.Lock()


class Tracker(Protocol):
    name: str

    def start(self, config: dict) -> None: ...

    def log(self, record: dict, step: int) -> None: ...

    def finish(self) -> None: ...


def scalars(record: dict, prefix: str = "") -> dict[str, float]:
    """The record's numbers, bools as 0/1, nested dicts as `outer/inner`; None, strings and
    lists are left out."""
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) or hasattr(value, "item"):
            try:
                out[name] = float(value)
            except (TypeError, ValueError):  # a non-scalar array
                continue
    return out


def report_folder(storage_uri: str, run_name: str, endpoint=None):
    """(StorageLocation of the storage, path inside it) of the run's report folder
    `<storage>/reports/<run>`; `endpoint`: the run's S3Endpoint (None: this process's environment)."""
    loc = open_location(storage_uri, endpoint=endpoint)
    return loc, loc.path(f"reports/{run_name}")


def wandb_run_id(run_name: str, report_url: str) -> str:
    """W&B's id of a vime run: stable for the same run name and storage (so a resumed run logs
    into the same W&B run), different for the same name in another storage (the default job's
    name is the same everywhere). W&B ids take letters, digits, `-` and `_`.

    A resumed driver opens the same W&B run (resume="allow"), and W&B drops steps below the ones it has."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "-", run_name)
    return f"{safe}-{hashlib.sha256(report_url.encode()).hexdigest()[:8]}"


class WandbTracker:
    name = "wandb"

    def __init__(self, project: str, run_id: str, run_name: str, group: str, mode: str, folder: str):
        self.project, self.run_id, self.run_name = project, run_id, run_name
        self.group, self.mode, self.folder = group, mode, folder
        self.run = None

    def start(self, config: dict) -> None:
        import wandb  # boundary: optional and heavy, only with --use-wandb (module docstring)

        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
        self.run = wandb.init(
            project=self.project,
            id=self.run_id,
            name=self.run_name,
            group=self.group or None,
            mode=self.mode,
            dir=self.folder or None,
            config=config,
            resume="allow",
            reinit="create_new",  # another vime run in this process keeps its own W&B run
            settings=wandb.Settings(quiet=True),  # the run's folder or link, not a history table at the end
        )

    def log(self, record: dict, step: int) -> None:
        self.run.log(scalars(record), step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class TensorBoardTracker:
    """Event files in `folder` (on the local disk). For a remote store, `folder` is a local
    staging folder and each flush copies its files to `remote` (StorageLocation, folder key).

    A resumed writer starts with a restart marker at its first step, so TensorBoard hides what an
    earlier writer logged at that step or later (an iteration run again is shown once)."""

    name = "tensorboard"

    def __init__(self, folder: str, remote: tuple[Any, str] | None = None):
        self.folder, self.remote = folder, remote
        self.writer = None

    def start(self, config: dict) -> None:
        os.makedirs(self.folder, exist_ok=True)  # the configuration is config.json beside it

    def log(self, record: dict, step: int) -> None:
        # boundary: optional and heavy, only with --use-tensorboard (module docstring)
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.compat.proto.summary_pb2 import Summary

        if self.writer is None:
            # boundary: optional (--use-tensorboard)
            from tensorboard.summary.writer.event_file_writer import EventFileWriter

            self.writer = EventFileWriter(self.folder)
            # the restart marker: TensorBoard hides what earlier writers logged at steps >= this
            self.writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))
        values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars(record).items()]
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=Summary(value=values)))
        self.writer.flush()
        self._mirror()

    def _mirror(self) -> None:
        if self.remote is None:
            return
        location, key = self.remote
        for name in os.listdir(self.folder):
            location.put_file(f"{key}/{name}", os.path.join(self.folder, name))

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
            self._mirror()


class Tracking:
    """The trackers of one run, each turned off at its first failure, with one warning."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = list(trackers)
        self.started = False

    def _each(self, call) -> list[str]:
        warnings = []
        for tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 - any failure of a tracker must not end the run
                self.trackers.remove(tracker)
                first = (str(exc).strip().splitlines() or [""])[0][:200]
                warnings.append(
                    f"{tracker.name} tracking failed and is off for this run: {type(exc).__name__}: {first}"
                )
        return warnings

    def start(self, config: dict) -> list[str]:
        self.started = True
        return self._each(lambda t: t.start(config))

    def log(self, record: dict, step: int) -> list[str]:
        return self._each(lambda t: t.log(record, step))

    def finish(self) -> list[str]:
        return self._each(lambda t: t.finish())


def trackers_for(cfg) -> list[Tracker]:
    """The trackers `cfg` asks for (none without --use-wandb / --use-tensorboard)."""
    trackers: list[Tracker] = []
    if not (cfg.use_wandb or cfg.use_tensorboard):
        return trackers
    loc, folder = report_folder(cfg.storage_uri, cfg.run_name, S3Endpoint.of(cfg))
    if cfg.use_wandb:
        # W&B writes its files on the local disk: the run's report folder when that is local
        wandb_dir = cfg.wandb_dir or (folder if loc.is_local else "")
        trackers.append(
            WandbTracker(
                project=cfg.wandb_project,
                run_id=wandb_run_id(cfg.run_name, loc.url(f"reports/{cfg.run_name}")),
                run_name=cfg.wandb_run_name or cfg.run_name,
                group=cfg.wandb_group,
                mode=cfg.wandb_mode,
                folder=wandb_dir,
            )
        )
    if cfg.use_tensorboard:
        if loc.is_local:
            trackers.append(TensorBoardTracker(f"{folder}/tensorboard"))
        else:
            staging = tempfile.mkdtemp(prefix=f"vime-tensorboard-{cfg.run_name}-")
            trackers.append(TensorBoardTracker(staging, remote=(loc, f"reports/{cfg.run_name}/tensorboard")))
    return trackers


def track(cfg, record: dict, step: int, last: bool) -> list[str]:
    """Send one iteration's record to the run's trackers, starting them (with the resolved
    configuration) on the first call of this process and finishing them after the `last`
    iteration. Returns warnings for trackers that failed; nothing when no tracker is asked for."""
    if not (cfg.use_wandb or cfg.use_tensorboard):
        return []
    warnings: list[str] = []
    key = f"{cfg.storage_uri} {cfg.run_name}"
    with _LOCK:
        tracking = _OPEN.get(key)
        if tracking is None:
            try:
                tracking = Tracking(trackers_for(cfg))
            except Exception as exc:  # noqa: BLE001 - e.g. the storage cannot be opened
                tracking = Tracking([])
                warnings.append(f"tracking is off for this run: {type(exc).__name__}: {exc}")
            _OPEN[key] = tracking
            warnings += tracking.start(config_dict(cfg))
        warnings += tracking.log(record, step)
        if last:
            warnings += tracking.finish()
            del _OPEN[key]
    return warnings


def finish_all() -> list[str]:
    """Finish every open tracker (at interpreter exit: a run that stopped before its last
    iteration still closes its W&B run and event files)."""
    warnings: list[str] = []
    with _LOCK:
        for key in list(_OPEN):
            warnings += _OPEN.pop(key).finish()
    return warnings


atexit.register(finish_all)  # a no-op when nothing is open
