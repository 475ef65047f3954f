"""One RL iteration as one Prefect flow run: `iter-k vV->vV+1`.

rollout -> build -> persist -> offload rollout -> train -> onload weights -> sync -> onload KV,
then eval and save when their intervals say so, then (rollout_prefetch) the start of rollout k+1
on the new weights, which runs while this flow run reports and ends and the next one starts.
Every task is idempotent per rollout id, so a retried or re-run iteration picks up where it
failed.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.runtime import flow_run

from tasks.checkpoint import save_checkpoint
from tasks.evaluate import evaluate
from tasks.placement import engines_sleep, offload_rollout, onload_kv, onload_weights
from tasks.report import CURVE_EVERY, report_iteration
from tasks.rollout import persist, rollout, start_next_rollout
from tasks.sync import sync_weights
from tasks.train import train
from vime_core.config import VimeConfig


def version_before(rollout_id: int) -> int:
    """Weights are v1 after bootstrap and one version per trained rollout: rollout k samples v(k+1)."""
    return rollout_id + 1


def _run_name() -> str:
    k = flow_run.parameters["rollout_id"]
    return f"iter-{k} v{version_before(k)}->v{version_before(k) + 1}"


def _due(interval: int | None, rollout_id: int, last: int) -> bool:
    return rollout_id == last or (interval is not None and (rollout_id + 1) % interval == 0)


@flow(name="iteration", flow_run_name=_run_name, log_prints=True, retries=0)
def iteration(config: VimeConfig, rollout_id: int) -> dict:
    t0 = time.perf_counter()
    v = version_before(rollout_id)
    out = rollout(config, rollout_id, v)
    stored = persist(config, rollout_id, out, str(flow_run.id or ""))
    # offload/onload tasks run only where engines can sleep: on CPU they would be no-op task
    # runs, ~12 ms of Prefect bookkeeping each (bench/bench_orchestration.py)
    moves = engines_sleep(config)
    t_offload = offload_rollout(config, rollout_id) if moves else 0.0
    train_metrics = train(config, rollout_id, out.batch_ref)
    t_onload_w = onload_weights(config, rollout_id) if moves else 0.0
    last = config.num_rollout - 1
    sync = sync_weights(config, v + 1, resume_admission=rollout_id != last)
    t_onload_kv = onload_kv(config, rollout_id) if moves else 0.0
    record = {
        "rollout_id": rollout_id,
        "version_before": v,
        "version_after": v + 1,
        **{k.removeprefix("rollout/"): val for k, val in out.metrics.items() if not isinstance(val, (dict, list))},
        "t_build": out.metrics.get("rollout/time_build_s", 0.0),
        **{f"train_{k}" if k in ("loss",) else k: val for k, val in train_metrics.items() if not isinstance(val, (dict, list))},
        "clip_fraction": train_metrics.get("pg_clipfrac", train_metrics.get("clip_fraction")),
        "t_persist": stored.get("t_persist", 0.0),
        "t_write_s": stored.get("t_write_s", 0.0),
        "publish_s": (sync.get("seconds") or {}).get("total", 0.0),
        "t_offload": t_offload,
        "t_onload": t_onload_w + t_onload_kv,
        "t_sync": sync.get("t_sync"),
        "batch_key": stored.get("key", ""),
        "from_store": out.from_store,
    }
    if config.eval_interval and _due(config.eval_interval, rollout_id, last):
        ev = evaluate(config, rollout_id)
        record["eval_reward_mean"] = ev.get("reward_mean")
    if _due(config.save_interval, rollout_id, last):
        record["checkpoint"] = save_checkpoint(config, rollout_id)["path"]
    if config.rollout_prefetch and rollout_id != last:
        start_next_rollout(config, rollout_id + 1, v + 1)
    record["t_step"] = time.perf_counter() - t0
    report_iteration(config, rollout_id, record, draw_curve=_due(CURVE_EVERY, rollout_id, last))
    return record
