"""The run guard in the iteration flow: the checks of vime_core/report/guard.py on the rollout's
metrics right after the rollout (nothing trains on a batch that breaches) and on the trainer's
right after training, before the publish, the evaluation and the checkpoint (no weights that
breach reach the engines or a checkpoint). Where the publish is chained on training inside Ray
(tasks.sync.train_then_publish), `gate` puts the trainer's checks between the two.

A breach (guard_action stop) ends the iteration's flow run Failed with one line naming the
check, after recording it: the breach in the run's `guard.jsonl` beside metrics.jsonl (the
iteration's metrics, the running values it was judged against, the discarded batch), a Prefect
artifact, the error in the flow run's log; the iteration's batch quarantined and unpublished
(BatchStore.discard: its lineage kept, the rollout generated again on resume); the
RolloutManager's data source put back before the rollout; a trainer that trained the batch
marked to be rebuilt from its last checkpoint by the next bootstrap. GuardBreachError is a
ValueError: the train flow does not retry it (vime_core/faults.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import ray
from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks.common import run_handles
from tasks.rollout import persist_for
from tasks.sync import Submitted, settle
from vime_core.config import VimeConfig
from vime_core.faults import raised_in_chain
from vime_core.report.guard import (
    Breach,
    GuardBreachError,
    GuardSettings,
    History,
    breach_message,
    metric_view,
    rollout_breaches,
    train_breaches,
)
from vime_core.report.records import read_records, report_location, run_dir
from vime_core.storage import BatchStore
from vime_core.storage.endpoint import S3Endpoint

BREACHES = "guard.jsonl"  # in the run's report folder, beside metrics.jsonl


@dataclass(frozen=True)
class IterationGuard:
    """The guard of one iteration: its settings and the history it is judged against."""

    config: VimeConfig
    rollout_id: int
    settings: GuardSettings
    history: History
    breaches_before: int = 0  # earlier breaches of this rollout id (rolled back, or stopped and resumed)
    gates: list = field(default_factory=list, compare=False)  # the gate calls made, to collect a failed one

    @classmethod
    def start(cls, config: VimeConfig, rollout_id: int) -> "IterationGuard":
        """The history from the run's stored records (a resumed run keeps its running values)."""
        settings = GuardSettings.of(config)
        records = read_records(config.storage_uri, config.run_name, S3Endpoint.of(config))
        earlier = sum(1 for b in previous_breaches(config) if b.get("rollout_id") == rollout_id)
        return cls(config, rollout_id, settings, History.of(records, rollout_id, settings.window), earlier)

    def record_fields(self) -> dict:
        """What the accepted iteration's record says of the guard."""
        return {"guard_breaches_before": self.breaches_before}

    def check_rollout(self, out: Any, flow_run_id: str) -> None:
        """The rollout's checks; on a breach the batch is stored, then discarded, and the flow
        run fails (module docstring)."""
        breaches = rollout_breaches(self.settings, self.history, out.metrics)
        if breaches:
            # kept aside by the discard, lineage whole
            persist_for(self.config)(self.config, self.rollout_id, out, flow_run_id)
            self.stop(breaches, "rollout", out.metrics, {}, trained_on=False)

    def check_trained(self, out: Any, trained: dict, submitted: Any = None) -> None:
        """The trainer's checks, once training and persist ended; `submitted`: the publish that
        `gate` held back, collected so Ray does not report its error again."""
        breaches = train_breaches(self.settings, self.history, trained)
        if breaches:
            settle(submitted)  # the held-back publish's failed calls, so Ray does not report them again
            settle(Submitted(train=list(self.gates)))
            self.stop(breaches, "train", out.metrics, trained, trained_on=True)

    def gate(self, trained_refs: list) -> list:
        """A Ray reference that succeeds only when the trainer's metrics (rank 0's, all-reduced)
        pass the checks: the publish chained on it (tasks.sync.publish's `after`) runs only then."""
        self.gates.append(_gate_function().remote(self.settings, self.history, *trained_refs))
        return [self.gates[-1]]

    def stop(self, breaches: list[Breach], phase: str, rollout_metrics: dict, trained: dict, trained_on: bool) -> None:
        """Record the breach, discard what the iteration made (its batch is stored by now), and
        raise GuardBreachError."""
        message = breach_message(self.rollout_id, breaches)
        log = get_run_logger()
        log.error(message)
        discarded = self._discard(message, trained_on)
        record = {
            "rollout_id": self.rollout_id,
            "attempt": self.breaches_before + 1,
            "phase": phase,
            "guard_action": self.config.guard_action,
            "guard_breaches": [b.as_dict() for b in breaches],
            "guard_history": self.history.as_dict(),
            "discarded_batch": discarded.get("batch"),
            "trainer_rebuilt_from_checkpoint": discarded.get("trainer", False),
            "data_source_rewound": discarded.get("data_source", False),
            "metrics": {
                **{k: v for k, v in metric_view(rollout_metrics).items() if not isinstance(v, (dict, list))},
                **{k: v for k, v in trained.items() if not isinstance(v, (dict, list))},
            },
        }
        endpoint = S3Endpoint.of(self.config)
        reports = report_location(self.config.storage_uri, self.config.run_name, endpoint)
        reports.append_line(BREACHES, (json.dumps(record, sort_keys=True, default=str) + "\n").encode())
        create_markdown_artifact(
            key=_artifact_key(self.config.run_name),
            markdown=breach_markdown(record, f"{run_dir(self.config.storage_uri, self.config.run_name)}/{BREACHES}"),
            description=f"run guard: rollout {self.rollout_id} stopped",
        )
        raise GuardBreachError(message)

    def _discard(self, reason: str, trained_on: bool) -> dict:
        """Quarantine and unpublish the batch, rewind the data source, mark the trainer; what was
        done. Each step on its own: one that fails is logged and the others still run."""
        log, done = get_run_logger(), {}
        manager, trainers = run_handles(self.config)
        try:
            batch = BatchStore.for_config(self.config).discard(self.config.run_name, self.rollout_id, reason)
            done["batch"] = {k: batch.get(k) for k in ("key", "quarantined_key", "checksum", "quarantined_at")}
            log.warning("run guard: batch of rollout %d quarantined at %s", self.rollout_id, batch["quarantined_key"])
        except Exception as exc:  # noqa: BLE001 - the breach is what the user must see first
            log.warning("run guard: the batch of rollout %d could not be quarantined: %s", self.rollout_id, exc)
        try:
            done["data_source"] = bool(ray.get(manager.forget_rollout.remote(self.rollout_id)))
        except Exception as exc:  # noqa: BLE001
            log.warning("run guard: the RolloutManager could not forget rollout %d: %s", self.rollout_id, exc)
        if trained_on:
            try:
                trainers.call("discard_trained", self.rollout_id)
                done["trainer"] = True
            except Exception as exc:  # noqa: BLE001
                log.warning("run guard: the trainer could not be marked for a rebuild: %s", exc)
        return done


@lru_cache(maxsize=None)
def _gate_function():
    @ray.remote(num_cpus=0)
    def guard_gate(settings: GuardSettings, history: History, *per_rank: dict) -> bool:
        breaches = train_breaches(settings, history, dict(per_rank[0] or {}))
        if breaches:
            raise GuardBreachError("; ".join(b.line() for b in breaches))
        return True

    return guard_gate


def breach_markdown(record: dict, where: str) -> str:
    """The artifact: what breached, against what, what was discarded, what to do."""
    rows = "\n".join(
        f"| {b['check']} | `{b['metric']}` | {b['value']} | {b['limit']} | {b['detail']} |"
        for b in record["guard_breaches"]
    )
    history = ", ".join(f"{k} {v}" for k, v in record["guard_history"].items())
    batch = record.get("discarded_batch") or {}
    return (
        f"### Run guard: rollout {record['rollout_id']} stopped ({record['phase']})\n\n"
        f"| check | metric | value | limit | detail |\n|---|---|---|---|---|\n{rows}\n\n"
        f"Judged against: {history}.\n\n"
        f"Discarded batch: `{batch.get('key')}` (quarantined at `{batch.get('quarantined_key')}`); "
        f"trainer rebuilt from its last checkpoint on resume: {record['trainer_rebuilt_from_checkpoint']}.\n\n"
        f'Every breach of the run: `{where}`. What to do: docs/troubleshooting.md, "The run guard stopped the run".'
    )


def _artifact_key(run_name: str) -> str:
    safe = "".join(c if c.isalnum() else "-" for c in run_name.lower())
    return f"{safe}-run-guard"


def rollback_due(config: VimeConfig, exc: BaseException, failed: int) -> bool | None:
    """None when `exc` is no run-guard breach; else whether the iteration runs again after a
    rollback: guard_action rollback and at most guard_retries failed attempts so far (`failed`
    counts this one). The train flow's retry then rebuilds what the breach marked (bootstrap)."""
    if not raised_in_chain(exc, (GuardBreachError,)):
        return None
    return config.guard_action == "rollback" and failed <= config.guard_retries


def stopped_why(config: VimeConfig, failed: int) -> str:
    """What the run's last line says after a breach that is not rolled back."""
    after = f" after {failed - 1} rollback(s) (guard_retries={config.guard_retries})" if failed > 1 else ""
    return (
        f"the run guard stopped the run{after}; the engines and the checkpoints hold the last good weights, the "
        f"breach is in {run_dir(config.storage_uri, config.run_name)}/{BREACHES}: fix its cause "
        f"(docs/troubleshooting.md) and run the same command to resume"
    )


def previous_breaches(config: VimeConfig) -> list[dict]:
    """Every breach the run recorded, in order (guard.jsonl)."""
    reports = report_location(config.storage_uri, config.run_name, S3Endpoint.of(config))
    try:
        text = reports.get(BREACHES).decode()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
