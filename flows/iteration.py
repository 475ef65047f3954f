"""One RL iteration as one Prefect flow run, `iter-k vV->vV+1`: the rollout, then one of three schedules
planned by vime_core/step_plan.py (each a function read in the order it runs), then eval, the
checkpoint and the report. Every task is idempotent per rollout id, so a retried or re-run iteration
picks up where it failed, and the sync ends only after the batch is stored: no rollout starts on
weights trained on a batch that is not. The run guard (tasks/guard.py) checks the rollout before
training and the trainer before the publish; a breach fails the flow run there."""

from __future__ import annotations

from prefect import flow
from prefect.runtime import flow_run
from prefect.utilities.annotations import quote

from flows.settings import send_run_logs
from tasks.checkpoint import save_checkpoint
from tasks.evaluate import evaluate
from tasks.guard import IterationGuard
from tasks.offload import offload_rollout, offload_train, onload_kv, onload_weights
from tasks.report import report_iteration
from tasks.rollout import persist_for, rollout, start_next_rollout
from tasks.sync import check_weights, sync, train_then_publish
from tasks.train import train
from vime_core.config import VimeConfig
from vime_core.step_plan import Phase, StepPlan, iteration_record, plan_step, version_before
from vime_core.utils import interrupt
from vime_core.utils.timing import Stopwatch


def _run_name() -> str:
    v = version_before(flow_run.parameters["rollout_id"])
    return f"iter-{flow_run.parameters['rollout_id']} v{v}->v{v + 1}"


@flow(name="iteration", flow_run_name=_run_name, log_prints=True, retries=0)
def iteration(config: VimeConfig, rollout_id: int) -> dict:
    """rollout, then the schedule's phases (one function each, below), then eval, save, report."""
    interrupt.reinstall()  # the flow run took SIGTERM over: vime_core/utils/interrupt.py
    send_run_logs()  # a deployment may start an iteration alone
    step, k, plan = Stopwatch(), rollout_id, plan_step(config, rollout_id)
    cfg = quote(config)  # Prefect then does not walk the configuration's fields for futures (a cost per task run)
    out = rollout(cfg, k, plan.version)
    guard = IterationGuard.start(config, k)  # the run guard: tasks/guard.py
    guard.check_rollout(out, str(flow_run.id or ""))
    if plan.off_policy:
        done = _one_step_off_policy(cfg, plan, out, guard)
    elif plan.engines_sleep:
        done = _engines_asleep(cfg, plan, out, guard)
    else:
        done = _engines_awake(config, cfg, plan, out, guard)
    done[Phase.EVAL] = evaluate(cfg, k) if plan.eval_due else {}
    done[Phase.SAVE] = save_checkpoint(cfg, k, plan.engines_sleep and plan.trainer_sleeps) if plan.save_due else {}
    if plan.flow_starts_next(out.next_stored):
        start_next_rollout(cfg, k + 1, plan.next_version)
    record = iteration_record(plan, out.metrics, out.from_store, done, step.seconds)
    record.update(guard.record_fields())
    report_iteration(cfg, k, record, draw_curve=plan.draw_curve)
    return record


def _engines_asleep(cfg, plan: StepPlan, out, guard: IterationGuard) -> dict[Phase, dict]:
    """Iteration k's phases up to eval where the engines sleep while the trainer trains
    (colocated on GPUs): each task makes its own calls, one after another, in the order read."""
    k, done = plan.rollout_id, {}
    persisting = persist_for(cfg.unquote()).submit(cfg, k, out, str(flow_run.id or ""))
    try:
        done[Phase.OFFLOAD_ROLLOUT] = offload_rollout(cfg, k)
        done[Phase.TRAIN] = train(cfg, k, out.batch_ref)
    finally:
        persisting.wait()  # stored even when training fails: a re-run loads it
    done[Phase.PERSIST] = persisting.result()
    guard.check_trained(out, done[Phase.TRAIN])
    done[Phase.OFFLOAD_TRAIN] = offload_train(cfg, k) if plan.trainer_sleeps else {}
    done[Phase.ONLOAD_WEIGHTS] = onload_weights(cfg, k)
    done[Phase.SYNC] = sync(
        cfg,
        plan.next_version,
        resume_admission=not plan.last,
        start_rollout_id=plan.sync_starts_next(out.next_stored),
    )
    done[Phase.ONLOAD_KV] = onload_kv(cfg, k)
    done[Phase.CHECK_WEIGHTS] = check_weights(cfg, plan.next_version, done[Phase.SYNC]) if plan.check_weights else {}
    return done


def _engines_awake(config: VimeConfig, cfg, plan: StepPlan, out, guard: IterationGuard) -> dict[Phase, dict]:
    """Iteration k's phases up to eval where the engines stay awake (CPU; engines on their own
    devices): training and the publish go to Ray at once, chained by object references
    (train_then_publish: the publish starts the moment training ends); the train and sync tasks
    wait for those calls, and the sync ends the sync (admission resumed or rollout k + 1 started)."""
    k, done = plan.rollout_id, {}
    ahead = train_then_publish(config, k, out.batch_ref, plan.next_version, guard.gate)  # submitted to Ray
    persisting = persist_for(cfg.unquote()).submit(cfg, k, out, str(flow_run.id or ""))
    try:
        done[Phase.TRAIN] = train(cfg, k, out.batch_ref, ahead)  # waits for `ahead`'s training
    finally:
        persisting.wait()  # stored even when training fails: a re-run loads it
    done[Phase.PERSIST] = persisting.result()
    guard.check_trained(out, done[Phase.TRAIN], ahead)
    done[Phase.OFFLOAD_TRAIN] = offload_train(cfg, k) if plan.trainer_sleeps else {}
    done[Phase.SYNC] = sync(
        cfg,
        plan.next_version,
        resume_admission=not plan.last,
        start_rollout_id=plan.sync_starts_next(out.next_stored),
        submitted=ahead,
    )
    done[Phase.CHECK_WEIGHTS] = check_weights(cfg, plan.next_version, done[Phase.SYNC]) if plan.check_weights else {}
    return done


def _one_step_off_policy(cfg, plan: StepPlan, out, guard: IterationGuard) -> dict[Phase, dict]:
    """Iteration k's phases up to eval with async_staleness 1 (engines awake): the weights
    trained through k - 1 are published first and rollout k + 1 starts on them, in the sync's
    last actor call; the trainer then trains on k while rollout k + 1 generates. The last
    iteration also publishes what it trained, so a run ends with the engines on its final weights."""
    k, done = plan.rollout_id, {}
    done[Phase.SYNC] = sync(cfg, plan.version, start_rollout_id=plan.sync_starts_next(out.next_stored))
    done[Phase.CHECK_WEIGHTS] = check_weights(cfg, plan.version, done[Phase.SYNC]) if plan.check_weights else {}
    persisting = persist_for(cfg.unquote()).submit(cfg, k, out, str(flow_run.id or ""))
    try:
        done[Phase.TRAIN] = train(cfg, k, out.batch_ref)
    finally:
        persisting.wait()  # stored even when training fails: a re-run loads it
    done[Phase.PERSIST] = persisting.result()
    guard.check_trained(out, done[Phase.TRAIN])
    if plan.last:
        done[Phase.SYNC] = sync(cfg, plan.next_version, resume_admission=False)
        if plan.check_weights:
            done[Phase.CHECK_WEIGHTS] = check_weights(cfg, plan.next_version, done[Phase.SYNC])
    return done
