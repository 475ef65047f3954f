"""Iteration records of a run, appended to `<storage>/reports/<run>/metrics.jsonl`: one per finished
iteration (versions, reward and length statistics, training metrics, phase times T_*). Re-reading
keeps the last record per rollout id, so a retried iteration replaces its earlier one. The report
folder is written through the store's StorageLocation, local or object store alike."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Iterable

from vime_core.step_plan import PERIODIC_TERMS, T_STEP_TERMS
from vime_core.storage.fs import open_location
from vime_core.storage.layout import RUN_CONFIG, run_dir

if TYPE_CHECKING:
    from vime_core.storage.endpoint import S3Endpoint
    from vime_core.storage.fs import StorageLocation

# the files of a run's report folder
CONFIG = RUN_CONFIG  # read by the configuration too (vime_core/config/loader.py)
METRICS, REWARD_CURVE, SUMMARY = "metrics.jsonl", "reward_curve.png", "summary.json"


def report_location(storage_uri: str, run_name: str, endpoint: "S3Endpoint | None" = None) -> "StorageLocation":
    """The run's report folder `<storage>/reports/<run>`, keys being the file names above."""
    return open_location(run_dir(storage_uri, run_name), endpoint=endpoint)


def append_record(storage_uri: str, run_name: str, record: dict, endpoint: "S3Endpoint | None" = None) -> str:
    """Append one record to the run's metrics.jsonl (one write of one line locally; replaced
    whole on an object store: StorageLocation.append_line); returns the file's path or URI."""
    reports = report_location(storage_uri, run_name, endpoint)
    reports.append_line(METRICS, (json.dumps(record, sort_keys=True, default=_jsonable) + "\n").encode())
    return reports.url(METRICS)


def read_records(storage_uri: str, run_name: str, endpoint: "S3Endpoint | None" = None) -> list[dict]:
    """The last record of each rollout id, in rollout order. A line cut short (a process killed
    while appending) is skipped: its iteration is run again and appends it whole."""
    try:
        text = report_location(storage_uri, run_name, endpoint).get(METRICS).decode()
    except FileNotFoundError:
        return []
    by_id: dict[int, dict] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
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
    """`-` for a value the record lacks; NaN and Inf as `nan` and `inf`, never hidden as `-`."""
    if x is None:
        return "-"
    return format(x, spec)


def console_line(rec: dict) -> str:
    """`iter 7 v8->v9 reward 0.531 len 2.1 clip 0.012 T_step 2.41s [rollout 0.62 build 0.01 ...]`,
    with `skipped 2 steps` after clip when optimizer steps had a non-finite loss or gradient."""
    phases = " ".join(f"{term} {_fmt(rec.get('t_' + term), '.2f')}" for term in T_STEP_TERMS)
    # a prefetched rollout started in the previous iteration: its T_rollout is the wait for it
    early = f" (started early, {_fmt(rec.get('time_total_s'), '.2f')} generating)" if rec.get("prefetched") else ""
    # with a critic (ppo): its value loss and how much of the returns' variance its values explain
    critic = (
        f"vloss {_fmt(rec.get('value_loss'))} ev {_fmt(rec.get('explained_variance'), '.2f')} "
        if "value_loss" in rec
        else ""
    )
    return (
        f"iter {rec['rollout_id']:>3} v{rec.get('version_before', '?')}->v{rec.get('version_after', '?')} "
        f"reward {_fmt(rec.get('reward_mean'))} len {_fmt(rec.get('response_len_mean'), '.2f')} "
        f"clip {_fmt(rec.get('clip_fraction'))} {_skipped(rec)}{critic}T_step {_fmt(rec.get('t_step'), '.2f')}s "
        f"[{phases}{_periodic(rec)}]{early}"
    )


def recurring_step_s(rec: dict) -> float | None:
    """T_step less the periodic phases that ran in it (T_eval, T_save): the step a run pays every
    iteration, what a step time is compared on (a checkpoint of the optimizer state can double it).
    None for a record without t_step."""
    if rec.get("t_step") is None:
        return None
    return rec["t_step"] - sum(rec.get("t_" + term) or 0.0 for term in PERIODIC_TERMS)


def _periodic(rec: dict) -> str:
    """` eval 3.10 save 20.02`: the periodic phases that ran in this iteration."""
    return "".join(f" {term} {rec['t_' + term]:.2f}" for term in PERIODIC_TERMS if rec.get("t_" + term))


def _skipped(rec: dict) -> str:
    """`skipped 2 steps (critic 1) `: optimizer steps not applied (non-finite loss or gradient,
    vime_core/trainer/nonfinite.py); empty when none was."""
    policy, critic = int(rec.get("skipped_steps") or 0), int(rec.get("critic_skipped_steps") or 0)
    if not policy and not critic:
        return ""
    return f"skipped {policy} step{'s' if policy != 1 else ''}{f' (critic {critic})' if critic else ''} "


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
