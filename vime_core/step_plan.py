"""The step's plan: one iteration's phases (`Phase`) and which of its three schedules runs (engines
asleep, engines awake with training and the publish submitted ahead, one step off-policy), decided
from the configuration before the iteration starts. flows/iteration.py runs it; this module runs nothing."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Optional

from vime_core.config.derive import platform_supports_sleep
from vime_core.engines.adapters import serves_adapters
from vime_core.ledger import ROLLOUT_TOKENS, PhaseDevices, iteration_ledger


class Phase(StrEnum):
    """The phases' one vocabulary: each is its Prefect task's name (a task run is named
    `<phase>-<rollout id>`, the sync `sync-v<version>`) and its key in what the flow hands to
    iteration_record."""

    ROLLOUT = "rollout"
    PERSIST = "persist"
    OFFLOAD_ROLLOUT = "offload-rollout"
    TRAIN = "train"
    OFFLOAD_TRAIN = "offload-train"
    ONLOAD_WEIGHTS = "onload-weights"
    SYNC = "sync"
    ONLOAD_KV = "onload-kv"
    CHECK_WEIGHTS = "check-weights"
    EVAL = "eval"
    SAVE = "save"
    START_NEXT_ROLLOUT = "start-next-rollout"
    REPORT = "report"


# The record's phase times `t_<term>` (docs/architecture.md's T_step = T_rollout + T_build + ...), in step
# order, and the phases each term sums: build is the rollout's own batch building; offload and
# onload add the engines' and the trainer's moves. Stored records are read by these keys.
T_STEP_TERMS = {
    "rollout": (Phase.ROLLOUT,),
    "build": (Phase.ROLLOUT,),
    "persist": (Phase.PERSIST,),
    "offload": (Phase.OFFLOAD_ROLLOUT, Phase.OFFLOAD_TRAIN),
    "train": (Phase.TRAIN,),
    "onload": (Phase.ONLOAD_WEIGHTS, Phase.ONLOAD_KV),
    "sync": (Phase.SYNC,),
}
# The phases that run every eval_interval / save_interval iterations only (t_eval, t_save): T_step
# includes them where they ran; report.records.recurring_step_s leaves them out.
PERIODIC_TERMS = ("eval", "save")
# The reward curve and its artifact every 10th iteration and on the last (drawing is not free,
# the artifact one more API call); the metrics table every iteration.
CURVE_EVERY = 10


def engines_sleep(cfg: Any) -> bool:
    """Engines offload and the platform can put them to sleep (not vLLM's CPU build)."""
    return bool(cfg.offload_rollout) and platform_supports_sleep(cfg)


def trainer_sleeps(cfg: Any) -> bool:
    """offload_train asked for, and the trainer is on a GPU (on CPU there is nothing to free)."""
    return bool(cfg.offload_train) and cfg.device == "cuda"


def version_before(rollout_id: int) -> int:
    """Weights are v1 after bootstrap and one version per trained rollout: rollout k samples v(k+1)."""
    return rollout_id + 1


def due(interval: Optional[int], rollout_id: int, last: int) -> bool:
    """Every `interval` rollouts (ids interval-1, 2*interval-1, ...) and on the last one."""
    return rollout_id == last or (bool(interval) and (rollout_id + 1) % interval == 0)


@dataclass(frozen=True)
class StepPlan:
    """What one iteration runs, decided before it starts.

    Engines asleep (GPU, colocated): rollout k on v = k + 1 -> offload-rollout (engines sleep) -> train ->
    offload-train (the trainer's weights stay until the publish copied them) -> onload-weights -> sync
    (the publish v -> v + 1) -> onload-kv -> check-weights -> eval, save at their intervals. Nothing is
    prefetched: the KV cache is awake only after onload-kv.

    Engines awake (CPU; engines on their own GPUs): no engine moves; training and the publish are
    submitted to Ray right after the rollout, chained on the batch's object reference, so the train and
    sync tasks wait for calls already running; with rollout_prefetch the sync starts rollout k + 1 on
    the new weights (after the evaluation, when one is due).

    One step off-policy (async_staleness 1, engines awake): rollout k (on v - 1) -> sync v -> check-weights
    -> train on k while rollout k + 1 generates -> eval, save; the last iteration then publishes v + 1.
    A sample trains at most one version behind the weights it was sampled with."""

    rollout_id: int
    version: int  # the weights rollout_id samples with; the publish makes version + 1
    last: bool
    engines_sleep: bool
    trainer_sleeps: bool
    check_weights: bool
    eval_due: bool
    save_due: bool
    draw_curve: bool
    prefetch_wanted: bool
    off_policy: bool = False  # async_staleness: one step off-policy (module docstring)
    devices: PhaseDevices = PhaseDevices()  # what each phase holds, for the compute ledger

    @property
    def next_version(self) -> int:
        return self.version + 1

    def prefetch(self, next_stored: bool) -> bool:
        """Start rollout k + 1 early: asked for, not the last rollout, engines awake after the
        publish, and not already stored (a resumed run replays a stored batch instead)."""
        return self.prefetch_wanted and not next_stored

    def sync_starts_next(self, next_stored: bool) -> Optional[int]:
        """The rollout id the sync's last actor call (end_sync) starts, or None. One step off-policy,
        rollout k + 1 starts even when an evaluation is due: overlapping is the point."""
        return self.rollout_id + 1 if self.prefetch(next_stored) and (self.off_policy or not self.eval_due) else None

    def flow_starts_next(self, next_stored: bool) -> bool:
        """The evaluation came first: the flow starts rollout k + 1 after it."""
        return self.prefetch(next_stored) and self.eval_due and not self.off_policy


def probe_alone(cfg: Any) -> bool:
    """Whether the weight check's probe must run with no rollout beside it, so nothing is
    prefetched: with lora_publish=adapter, vLLM (0.32) computes a prompt's log-probs under an
    adapter with one adapter index per request of the batch (`add_lora_logits`), and its engine
    dies when the probe shares a batch with other requests."""
    return bool(cfg.check_weight_update_equal) and serves_adapters(cfg)


def plan_step(cfg: Any, rollout_id: int) -> StepPlan:
    last_id = cfg.num_rollout - 1
    sleeping = engines_sleep(cfg)
    off_policy = bool(cfg.async_staleness) and not sleeping
    return StepPlan(
        rollout_id=rollout_id,
        version=version_before(rollout_id),
        last=rollout_id == last_id,
        engines_sleep=sleeping,
        trainer_sleeps=trainer_sleeps(cfg),
        check_weights=bool(cfg.check_weight_update_equal),
        eval_due=bool(cfg.eval_interval) and due(cfg.eval_interval, rollout_id, last_id),
        save_due=cfg.save_checkpoints and due(cfg.save_interval, rollout_id, last_id),
        draw_curve=due(CURVE_EVERY, rollout_id, last_id),
        prefetch_wanted=(bool(cfg.rollout_prefetch) or off_policy)
        and rollout_id != last_id
        and not sleeping
        and not probe_alone(cfg),
        off_policy=off_policy,
        devices=PhaseDevices.of(cfg),
    )


def _scalars(metrics: dict, prefix: str = "") -> dict:
    return {k.removeprefix(prefix): v for k, v in metrics.items() if not isinstance(v, (dict, list))}


def iteration_record(
    plan: StepPlan,
    rollout_metrics: dict,
    from_store: bool,
    phases: dict[str, dict],
    t_step: float,
) -> dict:
    """The iteration's record (metrics.jsonl, the Prefect artifact, the console line) from
    what each phase returned; `phases` maps a Phase to that phase's result ({} when it did not
    run). Times are seconds; memory is bytes, per engine / rank; "ledger" is the compute ledger
    (vime_core/ledger.py)."""
    get = lambda phase: phases.get(phase) or {}  # noqa: E731
    trained, stored, synced = get(Phase.TRAIN), get(Phase.PERSIST), get(Phase.SYNC)
    off_r, off_t = get(Phase.OFFLOAD_ROLLOUT), get(Phase.OFFLOAD_TRAIN)
    on_w, on_kv = get(Phase.ONLOAD_WEIGHTS), get(Phase.ONLOAD_KV)
    record = {
        "rollout_id": plan.rollout_id,
        "version_before": plan.version,
        "version_after": plan.next_version,
        **_scalars(rollout_metrics, "rollout/"),
        "t_build": rollout_metrics.get("rollout/time_build_s", 0.0),
        **{("train_" + k if k == "loss" else k): v for k, v in _scalars(trained).items()},
        "clip_fraction": trained.get("pg_clipfrac", trained.get("clip_fraction")),
        "t_persist": stored.get("t_persist", 0.0),
        "t_write_s": stored.get("t_write_s", 0.0),
        "publish_s": (synced.get("seconds") or {}).get("total", 0.0),
        # what the publish sent: "adapter" (lora_publish=adapter), else the weights' transport
        "publish_transport": synced.get("transport"),
        "publish_bytes": synced.get("bytes", 0),
        # where the publish's seconds go: gather, validate, pause, start, transfer, finish, resume,
        # verify (vime_core/weight_sync/publish.py), and the transport's own split (pack, wait_load)
        "publish_phases_s": {k: v for k, v in (synced.get("seconds") or {}).items() if k != "total"},
        "publish_transport_s": dict(synced.get("transport_seconds") or {}),
        "t_offload": off_r.get("seconds", 0.0) + off_t.get("seconds", 0.0),
        "t_offload_rollout": off_r.get("seconds", 0.0),
        "t_offload_train": off_t.get("seconds", 0.0),
        "t_onload": on_w.get("seconds", 0.0) + on_kv.get("seconds", 0.0),
        "t_wake_train": trained.get("wake_time_s", 0.0),
        "t_sync": synced.get("t_sync"),
        "batch_key": stored.get("key", ""),
        "from_store": from_store,
    }
    if record.get("weight_version_min") is not None:  # how many versions the oldest sampled token lags the trainer
        record["staleness"] = plan.version - int(record["weight_version_min"])
    if plan.engines_sleep or plan.trainer_sleeps:  # device memory after each move
        record["memory"] = {
            "engines_after_offload_rollout": off_r.get("memory"),
            "trainer_after_wake": trained.get("memory_after_wake"),
            "trainer_after_train": trained.get("memory_after_train"),
            "trainer_after_offload_train": off_t.get("memory"),
            "engines_after_onload_weights": on_w.get("memory"),
            "trainer_after_publish": synced.get("trainer_memory_after_publish"),
            "engines_after_onload_kv": on_kv.get("memory"),
        }
    if get(Phase.CHECK_WEIGHTS):
        record["weight_check"] = get(Phase.CHECK_WEIGHTS)
    if plan.eval_due:
        record["eval_reward_mean"] = get(Phase.EVAL).get("eval/reward_mean")  # RolloutManager.eval's keys
    if plan.save_due:
        record["checkpoint"] = get(Phase.SAVE).get("path")
    # the periodic phases, apart: T_step includes them on the iterations they run (PERIODIC_TERMS)
    record["t_eval"] = get(Phase.EVAL).get("t_eval", 0.0)
    record["t_save"] = get(Phase.SAVE).get("t_save", 0.0)
    record["t_step"] = t_step
    record["ledger"] = iteration_ledger(rollout_metrics.get(ROLLOUT_TOKENS), record, plan.devices)
    return record
