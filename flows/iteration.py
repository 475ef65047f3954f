"""One RL iteration as one Prefect flow run: `iter-k vV->vV+1`.

rollout -> build -> persist -> offload rollout -> train -> offload train -> onload weights ->
sync -> onload KV, then eval and save when their intervals say so. Offload train frees the
trainer's optimizer state and gradients; its weights stay until the publish in sync has copied
them out (CUDA IPC reads the trainer's memory) and are freed at its end. With rollout_prefetch, sync's last actor call
starts rollout k+1 on the new weights (after eval when one is due), so it runs while this flow
run saves, reports and ends and the next one starts.
Every task is idempotent per rollout id, so a retried or re-run iteration picks up where it
failed.

Where engines do not sleep, the rollout task also submits this rollout's training and publish
to Ray, chained on the batch's reference (tasks.dispatch): training starts the moment the batch
exists and the publish the moment training ends, while Prefect is still ending and starting
task runs; the train and sync tasks wait for them.

Persist runs beside offload + train (both only read the batch), and sync ends only after it:
no rollout is started on weights trained on a batch that is not stored. If the store fails
after the trainer trained, a re-run gets the same batch from the RolloutManager (it keeps its
last result until another rollout starts), the trainer does not train it again and engines
already at v+1 are not published to again, so the stored batch is the one trained on.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from tasks.checkpoint import save_checkpoint
from tasks.evaluate import evaluate
from tasks.placement import engines_sleep, offload_rollout, offload_train, onload_kv, onload_weights, trainer_sleeps
from tasks.report import CURVE_EVERY, report_iteration
from tasks.rollout import persist, rollout, start_next_rollout
from tasks.sync import check_weight_update, sync_weights
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
    # every task gets the configuration quoted: Prefect then does not walk its fields looking
    # for futures on each task run (~2 ms per task run on the 2-core machine)
    cfg = quote(config)
    out = rollout(cfg, rollout_id, v)
    persisting = persist.submit(cfg, rollout_id, out, str(flow_run.id or ""))
    try:
        # offload/onload tasks run only where engines can sleep: on CPU they would be no-op
        # task runs, ~4-10 ms of Prefect bookkeeping each (bench/bench_orchestration.py)
        moves = engines_sleep(config)
        offloaded = offload_rollout(cfg, rollout_id) if moves else {}
        train_metrics = train(cfg, rollout_id, out.batch_ref, out.dispatched)
    finally:
        persisting.wait()  # stored even when training fails: a re-run loads it
    stored = persisting.result()
    trainer_slept = offload_train(cfg, rollout_id) if trainer_sleeps(config) else {}
    onloaded_w = onload_weights(cfg, rollout_id) if moves else {}
    last = config.num_rollout - 1
    # no prefetch where engines sleep: their KV cache wakes only after sync
    prefetch = config.rollout_prefetch and rollout_id != last and not out.next_stored and not moves
    eval_due = bool(config.eval_interval) and _due(config.eval_interval, rollout_id, last)
    # sync starts rollout k+1 itself (one actor call, no task run of its own) unless an
    # evaluation comes first; a checkpoint taken meanwhile records the data source from before it
    sync = sync_weights(cfg, v + 1, resume_admission=rollout_id != last,
                        start_rollout_id=rollout_id + 1 if prefetch and not eval_due else None,
                        dispatched=out.dispatched)
    onloaded_kv = onload_kv(cfg, rollout_id) if moves else {}
    checked = check_weight_update(cfg, v + 1, sync) if config.check_weight_update_equal else {}
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
        "t_offload": offloaded.get("seconds", 0.0) + trainer_slept.get("seconds", 0.0),
        "t_offload_rollout": offloaded.get("seconds", 0.0),
        "t_offload_train": trainer_slept.get("seconds", 0.0),
        "t_onload": onloaded_w.get("seconds", 0.0) + onloaded_kv.get("seconds", 0.0),
        "t_wake_train": train_metrics.get("wake_time_s", 0.0),
        "t_sync": sync.get("t_sync"),
        "batch_key": stored.get("key", ""),
        "from_store": out.from_store,
    }
    if moves or trainer_slept:  # device memory after each move (bytes), on GPUs
        record["memory"] = {
            "engines_after_offload_rollout": offloaded.get("memory"),
            "trainer_after_wake": train_metrics.get("memory_after_wake"),
            "trainer_after_offload_train": trainer_slept.get("memory"),
            "engines_after_onload_weights": onloaded_w.get("memory"),
            "trainer_after_publish": sync.get("trainer_memory_after_publish"),
            "engines_after_onload_kv": onloaded_kv.get("memory"),
        }
    if checked:
        record["weight_check"] = checked
    if eval_due:
        ev = evaluate(cfg, rollout_id)
        record["eval_reward_mean"] = ev.get("reward_mean")
    if _due(config.save_interval, rollout_id, last):
        record["checkpoint"] = save_checkpoint(cfg, rollout_id)["path"]
    if prefetch and eval_due:
        start_next_rollout(cfg, rollout_id + 1, v + 1)
    record["t_step"] = time.perf_counter() - t0
    report_iteration(cfg, rollout_id, record, draw_curve=_due(CURVE_EVERY, rollout_id, last))
    return record
