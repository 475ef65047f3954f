"""The compute ledger of an iteration: where the tokens the engines generated went, and where the
devices' seconds went, in the iteration's record (step_plan.iteration_record, key "ledger").

Tokens are response tokens, counted where they are known and carried as counts: the rollout
counts what it generated and discarded (rollout/tokens.py, the metric ROLLOUT_TOKENS), the
trainer what it trained (trainer/rollout_training.py, `trained_tokens`):

    generated         response tokens the engines generated for this rollout: every request,
                      kept or not, plus those of a prefetched rollout discarded as stale
    trained           loss-mask-1 tokens of the optimizer steps the trainer applied
    discarded[cause]  tokens generated and never trained, one count per cause (CAUSES)
    generated         = trained + sum(discarded)   (unaccounted: the difference, 0 unless a custom
                        rollout or generate function bypasses the counting)
    useful_share      = trained / generated        (None when nothing was generated: a stored batch)
    truncated         trained tokens of samples cut at the length budget: vime trains truncated
                      samples as they are, so they are counted apart, not as a discard

Device-seconds = seconds x the devices a phase holds, from the record's phase times (T_*):

    rollout   t_rollout x E             E = engine devices (rollout_num_gpus)
    train     t_train x T               T = trainer devices (actor_num_nodes x actor_num_gpus_per_node)
    sync      t_sync x D                D = the run's devices: T colocated (engines share the
                                            trainer's devices), T + E disaggregated
    offload   t_offload_rollout x E + t_offload_train x T
    onload    t_onload x E              (engines wake weights, then the KV cache)
    persist   max(0, t_persist - t_train - t_offload_rollout) x D: the batch is written on the
              host beside offload and train, so it holds the devices only for the seconds it
              outlasts them (the sync waits for it)
    held      t_step x D                every device the run holds, for the whole step

On CPU machines the "devices" are the device slots the run declares, counted the same way.
trained_tokens_per_device_s = trained / held: what the devices the run holds buy, gaps and
overlaps included (phases that overlap, e.g. train and sync chained on CPU, are each counted
in full, so the phases' sum can exceed held; build, eval, save and the flow's own work are
inside held only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

# The rollout metric that carries the rollout's token counts (a dict: rollout/tokens.py).
ROLLOUT_TOKENS = "rollout/tokens"

# Why tokens the engines generated were not trained, one key per cause.
CAUSES: dict[str, str] = {
    "filter": "groups the dynamic filter rejected (not topped up with filter_exhausted=keep_rejected)",
    "surplus": "groups that completed after the batch was full (over-sampling)",
    "aborted": "requests cut when the batch was full (aborted or partial samples; with partial_rollout they "
    "come back next rollout with these tokens masked)",
    "generate_failed": "groups the engines failed to generate (generated again, or dropped and refilled)",
    "reward_failed": "kept samples whose reward function failed (loss mask 0)",
    "stale": "a prefetched rollout discarded because its weights or rollout id were not the ones asked for",
    "masked": "other loss-mask-0 tokens of kept samples (e.g. tool output appended to a response)",
    "skipped_steps": "trainable tokens of optimizer steps not applied (a non-finite loss or gradient, or a "
    "critic-only rollout)",
}
PHASES = ("rollout", "train", "sync", "offload", "onload", "persist")


@dataclass(frozen=True)
class PhaseDevices:
    """The devices each side of the run holds (module docstring)."""

    trainer: int = 1
    engines: int = 1
    colocated: bool = True

    @classmethod
    def of(cls, cfg: Any) -> "PhaseDevices":
        from vime_core.config.derive import trainer_num_devices

        engines = cfg.rollout_num_gpus or trainer_num_devices(cfg)
        return cls(trainer_num_devices(cfg), int(engines), bool(cfg.colocate))

    @property
    def run(self) -> int:
        """Every device the run holds: shared when colocated, else both sides."""
        return max(self.trainer, self.engines) if self.colocated else self.trainer + self.engines


def _num(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0.0


def device_seconds(record: dict, devices: PhaseDevices) -> dict[str, float]:
    """Seconds x devices per phase (module docstring), from an iteration record's T_* keys."""
    t = lambda key: _num(record.get(key))  # noqa: E731
    engines, trainer, run = devices.engines, devices.trainer, devices.run
    persist_wait = max(0.0, t("t_persist") - t("t_train") - t("t_offload_rollout"))
    return {
        "rollout": t("t_rollout") * engines,
        "train": t("t_train") * trainer,
        "sync": t("t_sync") * run,
        "offload": t("t_offload_rollout") * engines + t("t_offload_train") * trainer,
        "onload": t("t_onload") * engines,
        "persist": persist_wait * run,
    }


def iteration_ledger(rollout_tokens: Optional[dict], record: dict, devices: PhaseDevices) -> dict:
    """The iteration's ledger (module docstring) from the rollout's token counts (None: the batch
    was loaded from storage, nothing generated) and the record (trained_tokens, T_*)."""
    counts = rollout_tokens or {}
    generated = int(counts.get("generated", 0))
    discarded = {cause: int((counts.get("discarded") or {}).get(cause, 0)) for cause in CAUSES}
    trained = record.get("trained_tokens")
    trained = int(trained) if trained is not None else None
    if trained is not None and counts:
        # what the rollout handed on as trainable and the trainer did not train
        discarded["skipped_steps"] = max(0, int(counts.get("trainable", 0)) - trained)
    phases = device_seconds(record, devices)
    held = _num(record.get("t_step")) * devices.run
    return {
        "tokens_generated": generated,
        "tokens_trained": trained,
        "tokens_discarded": discarded,
        "tokens_truncated": int(counts.get("truncated", 0)),
        "tokens_unaccounted": generated - (trained or 0) - sum(discarded.values()) if counts else 0,
        "useful_share": trained / generated if generated and trained is not None else None,
        "device_s": phases,
        "device_s_held": held,
        "trained_tokens_per_device_s": trained / held if held and trained is not None else None,
        "devices": {"trainer": devices.trainer, "engines": devices.engines, "run": devices.run},
    }


def run_ledger(ledgers: Iterable[dict]) -> dict:
    """The run's totals over its iterations' ledgers: summed counts and seconds, the shares of the sums."""
    ledgers = [x for x in ledgers if x]
    generated = sum(x["tokens_generated"] for x in ledgers)
    trained = sum(x["tokens_trained"] or 0 for x in ledgers)
    held = sum(x["device_s_held"] for x in ledgers)
    return {
        "iterations": len(ledgers),
        "tokens_generated": generated,
        "tokens_trained": trained,
        "tokens_discarded": {c: sum(x["tokens_discarded"].get(c, 0) for x in ledgers) for c in CAUSES},
        "tokens_truncated": sum(x["tokens_truncated"] for x in ledgers),
        "useful_share": trained / generated if generated else None,
        "device_s": {p: sum(x["device_s"].get(p, 0.0) for x in ledgers) for p in PHASES},
        "device_s_held": held,
        "trained_tokens_per_device_s": trained / held if held else None,
    }


def ledger_line(rollout_id: int, ledger: dict) -> str:
    """`ledger 7: generated 1234 tok, trained 900 (72.9%); discarded filter 200 aborted 54; 12.3
    device-s held (rollout 4.1 train 6.0 ...), 73.2 trained tok/device-s`."""
    share = ledger["useful_share"]
    trained = ledger["tokens_trained"]
    # in CAUSES' and PHASES' order (a record read back from metrics.jsonl has its keys sorted)
    discarded = " ".join(f"{c} {n}" for c in CAUSES if (n := ledger["tokens_discarded"].get(c))) or "none"
    phases = " ".join(f"{p} {s:.1f}" for p in PHASES if (s := ledger["device_s"].get(p)))
    rate = ledger["trained_tokens_per_device_s"]
    return (
        f"ledger {rollout_id}: generated {ledger['tokens_generated']} tok, trained "
        f"{'-' if trained is None else trained}{'' if share is None else f' ({share * 100:.1f}%)'}; "
        f"discarded {discarded}; {ledger['device_s_held']:.1f} device-s held ({phases or 'no phase timed'}), "
        f"{'-' if rate is None else f'{rate:.1f}'} trained tok/device-s"
    )


def flat(ledger: dict, prefix: str = "") -> dict[str, Any]:
    """The ledger as one level of scalar columns (`tokens_discarded_filter`, `device_s_train`, ...)."""
    out: dict[str, Any] = {}
    for key, value in ledger.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}_"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def ledger_markdown(run: str, rollout_id: int, ledger: dict) -> str:
    """The ledger as the Prefect artifact's markdown: where the tokens went, where the device-seconds went."""
    generated = ledger["tokens_generated"]
    share = lambda n: f"{n / generated * 100:.1f}%" if generated and n is not None else "-"  # noqa: E731
    tokens = [("generated", generated), ("trained", ledger["tokens_trained"])]
    tokens += [(f"discarded: {cause}", n) for cause in CAUSES if (n := ledger["tokens_discarded"].get(cause))]
    tokens += [("truncated (trained)", ledger["tokens_truncated"])] if ledger["tokens_truncated"] else []
    held = ledger["device_s_held"]
    of_held = lambda s: f"{s / held * 100:.1f}%" if held else "-"  # noqa: E731
    phases = [(p, ledger["device_s"].get(p, 0.0)) for p in PHASES]
    rate = ledger["trained_tokens_per_device_s"]
    lines = [
        f"### Compute ledger, run `{run}`, rollout {rollout_id}",
        "",
        "| tokens | count | of generated |",
        "|---|---:|---:|",
        *(f"| {what} | {'-' if n is None else n} | {share(n)} |" for what, n in tokens),
        "",
        f"| phase | device-seconds | of held ({ledger['devices']['run']} devices x T_step) |",
        "|---|---:|---:|",
        *(f"| {p} | {s:.2f} | {of_held(s)} |" for p, s in phases),
        f"| held | {held:.2f} | |",
        "",
        f"trained tokens per device-second: {'-' if rate is None else f'{rate:.2f}'}",
    ]
    return "\n".join(lines)
