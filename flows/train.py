"""The train job: bootstrap once, then one iteration flow run per rollout id, resumable (bootstrap
restores the latest checkpoint; a stored batch is loaded, not generated again). An iteration that
failed for an infrastructure reason (vime_core/faults.py) is run again after a back-off, up to
`iteration_retries` times, from the rollout after the rebuilt trainer's checkpoint: no rollout id is
skipped or trained twice. Configuration and data errors are not retried."""

from __future__ import annotations

import json
import time

from prefect import flow, get_run_logger

from flows.console import one_line_failures
from flows.iteration import iteration
from flows.settings import send_run_logs, without_heartbeats
from tasks.bootstrap import bootstrap, prepare_assets
from tasks.checkpoint import compact_index, export_hf, export_peft
from tasks.guard import rollback_due, stopped_why
from vime_core.config import VimeConfig
from vime_core.config.derive import unused_settings
from vime_core.config.lora import lora_enabled
from vime_core.config.loader import describe, dump_config, run_config_uri
from vime_core.faults import CONFIGURATION, DEVICE_MEMORY, classify, retry_delay
from vime_core.ledger import run_ledger
from vime_core.report.curve import preload as preload_curve
from vime_core.report.records import METRICS, REWARD_CURVE, SUMMARY, read_records, report_location, reward_gain, run_dir
from vime_core.storage.endpoint import S3Endpoint
from vime_core.utils import interrupt
from vime_core.utils.processes import process_age_s
from vime_core.utils.timing import Stopwatch


@flow(name="train", flow_run_name="train-{config.run_name}", log_prints=True)
def train(config: VimeConfig) -> dict:
    interrupt.reinstall()  # the flow run took SIGTERM over: vime_core/utils/interrupt.py
    send_run_logs()
    log = get_run_logger()
    run_clock = Stopwatch()
    preload_curve()  # the first reward curve then costs only its drawing
    config = prepare_assets(config)
    log.info("resolved configuration:\n%s", describe(config))
    for line in unused_settings(config):
        log.warning(line)
    dump_config(config, run_config_uri(config.storage_uri, config.run_name))
    with one_line_failures():
        try:
            boot = bootstrap(config)
        except Exception as exc:
            raise start_failed(exc) from exc
        start = config.start_rollout_id if config.start_rollout_id is not None else first_unfinished(config, boot)
        startup_s = process_age_s()  # the command's start to the first iteration, as a user waits for it
        with without_heartbeats():
            iteration_walls, failed_attempts = run_iterations(config, start)
    compact_index(config)
    records = read_records(config.storage_uri, config.run_name, S3Endpoint.of(config))
    root = run_dir(config.storage_uri, config.run_name)
    export = export_hf(config, run_dir(config.storage_uri, config.run_name, "exports")) if config.export_hf else None
    adapter = (
        export_peft(config, run_dir(config.storage_uri, config.run_name, "adapter")) if lora_enabled(config) else None
    )
    summary = {
        "run_name": config.run_name,
        "iterations": len(records),
        "reward_first3": _mean([r.get("reward_mean") for r in records[:3]]),
        "reward_last3": _mean([r.get("reward_mean") for r in records[-3:]]),
        "reward_gain": reward_gain(records),
        "t_step_median": _median([r.get("t_step") for r in records]),
        "ledger": run_ledger(r.get("ledger") for r in records),  # the run's compute ledger (vime_core/ledger.py)
        "startup_s": startup_s,
        "bootstrap_marks_s": boot.get("bootstrap_marks_s"),
        # where the startup's seconds go, each mark in seconds since the command
        "startup_marks_s": {**(boot.get("startup_marks_s") or {}), "first_iteration": startup_s},
        "engine_compile_cache": boot.get("engine_compile_cache"),
        # the period of the loop: T_step plus the flow run's own start and end (what a user waits)
        "iteration_wall_median": _median(iteration_walls[1:] or iteration_walls),
        "iteration_walls": iteration_walls,
        "failed_attempts": failed_attempts,  # rollout id -> failed tries that were retried
        "wall_seconds": run_clock.seconds,
        "batches": run_dir(config.storage_uri, config.run_name, "batches"),
        "checkpoints": run_dir(config.storage_uri, config.run_name, "checkpoints"),
        "hf_export": export,
        "peft_adapter": adapter,  # with LoRA: the adapter as a PEFT folder, for PeftModel.from_pretrained
        "metrics": f"{root}/{METRICS}",
        "reward_curve": f"{root}/{REWARD_CURVE}",
    }
    summary["summary"] = write_summary(config, summary)
    printed = {k: v for k, v in summary.items() if k != "iteration_walls"}  # the file has them all
    log.info("summary:\n%s", json.dumps(printed, indent=2))
    return summary


def first_unfinished(config: VimeConfig, boot: dict) -> int:
    """The rollout id a resumed run starts at: the one after the trainer's last trained rollout,
    or an earlier one whose iteration did not end (no record: a driver killed after training,
    before the sync). Running that iteration again trains nothing twice (the trainer skips a
    rollout id it trained) and publishes what the engines lack."""
    records = read_records(config.storage_uri, config.run_name, S3Endpoint.of(config))
    reported = max((r["rollout_id"] for r in records), default=-1) + 1
    return min(boot["next_rollout_id"], reported)


class RunStoppedError(RuntimeError):
    """The run stopped; the message says why and what to do, in one line."""


class IterationFailedError(RunStoppedError):
    """An iteration failed and is not run again."""


class StartFailedError(RunStoppedError):
    """Bootstrap (placement, engines, trainer, checkpoint restore) failed after its retries."""


OUT_OF_MEMORY_ADVICE = (
    "not retried (the same step runs out again); lower one of the settings named and run the same command "
    "again to resume from the last checkpoint"
)


def start_failed(exc: Exception) -> StartFailedError:
    """The one-line error for a bootstrap that failed (logged, and returned to be raised)."""
    get_run_logger().debug("bootstrap failed", exc_info=exc)
    fault = classify(exc)
    if fault.kind == CONFIGURATION:
        why = "a configuration or data error; fix it and run the same command again"
    elif fault.kind == DEVICE_MEMORY:
        why = OUT_OF_MEMORY_ADVICE
    else:
        why = "run the same command again to retry (stored batches and checkpoints are kept)"
    message = f"the run could not start: {fault.what} ({fault.error_type}); {why}"
    get_run_logger().error(message)
    return StartFailedError(message)


def run_iterations(config: VimeConfig, start: int) -> tuple[list[float], dict[int, int]]:
    """Iterations `start` .. num_rollout-1, each failed one retried when the failure allows
    (module docstring). Returns each successful iteration flow run's seconds (start to end, as
    this flow sees it) and the failed attempts per rollout id."""
    walls: list[float] = []
    failures: dict[int, int] = {}  # failed attempts per rollout id
    rollout_id, rebuild = start, False
    while rollout_id < config.num_rollout:
        wall = Stopwatch()
        try:
            if rebuild:
                rollout_id = resume_point(config, start, rollout_id, bootstrap(config))
                rebuild = False
            iteration(config, rollout_id)
        except Exception as exc:
            failures[rollout_id] = failures.get(rollout_id, 0) + 1
            time.sleep(retry_or_raise(config, rollout_id, exc, failures[rollout_id]))
            rebuild = True
            continue
        walls.append(wall.seconds)
        rollout_id += 1
    return walls, failures


def retry_or_raise(config: VimeConfig, rollout_id: int, exc: Exception, failed: int) -> float:
    """After the `failed`-th failure of iteration `rollout_id`: the seconds to wait before the
    next attempt, or IterationFailedError when there is none. Says so in one line; the full
    traceback goes to the debug log."""
    log = get_run_logger()
    log.debug("iteration %d failed", rollout_id, exc_info=exc)
    fault = classify(exc)
    attempts = config.iteration_retries + 1
    what = f"iteration {rollout_id} failed: {fault.what} ({fault.error_type})"
    rollback = rollback_due(config, exc, failed)  # a run-guard breach: tasks/guard.py
    if rollback:
        log.warning(
            "%s; run guard: back to the last good weights, running it again (%d of %d)",
            what,
            failed,
            config.guard_retries,
        )
        return 0.0
    if rollback is False:
        log.error("%s; %s", what, stopped_why(config, failed))
        raise IterationFailedError(f"{what}; {stopped_why(config, failed)}") from exc
    if fault.retryable and failed < attempts:
        delay = retry_delay(config.iteration_retry_delay_s, failed + 1)
        log.warning("%s; retrying in %g s (attempt %d of %d)", what, delay, failed + 1, attempts)
        return delay
    if fault.retryable:
        why = (
            f"giving up after {attempts} attempts (iteration_retries={config.iteration_retries}); "
            f"run the same command again to resume"
        )
    elif fault.kind == CONFIGURATION:
        why = (
            "a configuration or data error, not retried; fix it and run the same command again to "
            "resume from the last checkpoint"
        )
    elif fault.kind == DEVICE_MEMORY:
        why = OUT_OF_MEMORY_ADVICE
    else:
        why = "not an infrastructure failure, not retried"
    log.error("%s; %s", what, why)
    raise IterationFailedError(f"{what}; {why}") from exc


def resume_point(config: VimeConfig, start: int, failed_id: int, boot: dict) -> int:
    """Where the loop goes on after bootstrap rebuilt what had died: the failed iteration again,
    or, when the trainer was rebuilt from an older checkpoint, the rollout after that checkpoint
    (its stored batches are trained again, in order)."""
    resume = max(start, min(failed_id, boot["next_rollout_id"]))
    if resume < failed_id:
        get_run_logger().warning(
            "trainer rebuilt from its checkpoint: training the stored batches of rollouts %d-%d again, "
            "then iteration %d",
            resume,
            failed_id - 1,
            failed_id,
        )
    return resume


def write_summary(config: VimeConfig, summary: dict) -> str:
    reports = report_location(config.storage_uri, config.run_name, S3Endpoint.of(config))
    reports.put_atomic(SUMMARY, (json.dumps(summary, indent=2, default=str) + "\n").encode())
    return f"{run_dir(config.storage_uri, config.run_name)}/{SUMMARY}"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _median(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None
