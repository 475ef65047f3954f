"""Iteration records of a run, kept as `metrics.jsonl` beside the run's batches.

Kept in `<storage>/reports/<run>/metrics.jsonl`. One record per finished iteration: rollout id, weight versions, reward and length statistics,
training metrics and the phase times T_rollout ... T_sync (seconds), with
T_step = wall time of the iteration. Records are appended, and re-reading them keeps the last
record per rollout id, so a retried iteration replaces its earlier record.
"""

from __future__ import annotations

import json
import math
import os
from typing import Iterable

PHASES = ("rollout", "build", "persist", "offload", "train", "onload", "sync")


def run_dir(storage_uri: str, run_name: str, kind: str = "reports") -> str:
    """Where a run's files of one kind live: `<storage>/<kind>/<run>`, beside the batch store's
    `batches/<run>` (kinds: reports, checkpoints, exports)."""
    return f"{storage_uri.rstrip('/')}/{kind}/{run_name}"


def _fs_and_path(uri: str):
    import fsspec

    fs, path = fsspec.core.url_to_fs(uri)
    return fs, path


def append_record(storage_uri: str, run_name: str, record: dict) -> str:
    """Append one record to the run's metrics.jsonl. A local file is appended to (one write of
    one line); an object store has no append, so there the file is read, extended and replaced
    whole (atomic, linear in the run's length)."""
    fs, root = _fs_and_path(run_dir(storage_uri, run_name))
    fs.makedirs(root, exist_ok=True)
    path = f"{root}/metrics.jsonl"
    line = json.dumps(record, sort_keys=True, default=_jsonable) + "\n"
    if _is_local(fs):
        with open(path, "a+b") as f:
            if f.tell() > 0:  # a line cut short by a killed writer stays on its own line
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())
        return path
    old = fs.cat_file(path).decode() if fs.exists(path) else ""
    with fs.open(path + ".tmp", "w") as f:
        f.write(old + line)
    fs.mv(path + ".tmp", path)
    return path


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def read_records(storage_uri: str, run_name: str) -> list[dict]:
    """The last record of each rollout id, in rollout order. A line cut short (a process killed
    while appending) is skipped: its iteration is run again and appends it whole."""
    fs, root = _fs_and_path(run_dir(storage_uri, run_name))
    path = f"{root}/metrics.jsonl"
    if not fs.exists(path):
        return []
    by_id: dict[int, dict] = {}
    lines = [line for line in fs.cat_file(path).decode().splitlines() if line.strip()]
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_id[rec["rollout_id"]] = rec
    return [by_id[k] for k in sorted(by_id)]


def _jsonable(x):
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _fmt(x, spec=".3f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x, spec)


def console_line(rec: dict) -> str:
    """`iter 7 v8->v9 reward 0.531 len 2.1 clip 0.012 T_step 2.41s [rollout 0.62 build 0.01 ...]`"""
    phases = " ".join(f"{p} {_fmt(rec.get('t_' + p), '.2f')}" for p in PHASES)
    # a prefetched rollout started in the previous iteration: its T_rollout is the wait for it
    early = f" (started early, {_fmt(rec.get('time_total_s'), '.2f')} generating)" if rec.get("prefetched") else ""
    return (
        f"iter {rec['rollout_id']:>3} v{rec.get('version_before', '?')}->v{rec.get('version_after', '?')} "
        f"reward {_fmt(rec.get('reward_mean'))} len {_fmt(rec.get('response_len_mean'), '.2f')} "
        f"clip {_fmt(rec.get('clip_fraction'))} T_step {_fmt(rec.get('t_step'), '.2f')}s [{phases}]{early}"
    )


def reward_gain(records: Iterable[dict], window: int = 3) -> float | None:
    """Mean reward of the last `window` iterations minus that of the first `window`."""
    r = [rec["reward_mean"] for rec in records if rec.get("reward_mean") is not None]
    if len(r) < 2 * window:
        return None
    return sum(r[-window:]) / window - sum(r[:window]) / window


def sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[min(len(bars) - 1, int((v - lo) / span * (len(bars) - 1) + 0.5))] for v in values)
