"""The run guard: checks that stop a run which goes bad without crashing, from each iteration's
record and the run's history (the accepted records before it, as stored in metrics.jsonl, so a
resumed run keeps its running medians). Pure functions of dicts: the flow decides where they run
(tasks/guard.py).

For iteration k, with H the accepted records of rollouts < k (the last `guard_window` of them),
med(x) the median of x over H and prev(x) x in the newest record of H:

    non-finite       any guarded metric NaN or +-Inf; the trainer's token means (entropy, the
                     losses, the k3 mismatch) only when no optimizer step was skipped (skipped
                     steps average in their non-finite values; max_skipped_steps rules them)
    grad norm        grad_norm > max(guard_grad_norm_factor * med(grad_norm), clip_grad)   (a norm the
                     clip would not touch is a step of the run's ordinary size, however small the
                     median: steps of all-zero advantages have norms near 0)
    entropy floor    entropy < guard_entropy_min
    entropy fall     entropy < (1 - guard_entropy_drop) * prev(entropy)
    k3 mismatch      train_rollout_k3_kl > guard_k3_max   (KL(engine || trainer) of the sampled tokens)
    reward failures  reward_failure_share > guard_reward_failure_share
    aborted samples  aborted_count / (submitted_groups * n_samples_per_prompt) > guard_aborted_share
    reward fall      med(reward_mean) - reward_mean > guard_reward_drop * max(|med(reward_mean)|, reward_scale)
                     reward_scale = med(reward_std) over H (a batch of constant rewards: 0): a fall
                     is measured against the reward's own spread as well as its level, so a run
                     whose median reward is still near 0 is not stopped by its noise

The checks against a running value (grad norm, reward fall) wait for `guard_warmup` accepted
records; the entropy fall needs one. A metric the record lacks (another estimator, a custom
rollout function) is not checked. The rollout's checks run on its metrics before training, the
trainer's on its metrics before the publish (tasks/guard.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

# what a breach is called in the record, the artifact and the error line
NONFINITE, GRAD_NORM, ENTROPY_MIN, ENTROPY_DROP = "non-finite", "grad-norm", "entropy-floor", "entropy-fall"
K3, REWARD_FAILURES, ABORTED, REWARD_DROP = "k3-mismatch", "reward-failures", "aborted", "reward-fall"

ROLLOUT_NONFINITE = ("reward_mean", "reward_std", "response_len_mean")
TRAIN_NONFINITE_ALWAYS = ("grad_norm",)
TRAIN_NONFINITE_UNSKIPPED = ("entropy", "train_loss", "pg_loss", "kl", "train_rollout_k3_kl")


class GuardBreachError(ValueError):
    """A run-guard check failed (one line); a data/training error the train flow does not retry
    as an infrastructure failure (vime_core/faults.py)."""


@dataclass(frozen=True)
class Breach:
    """One failed check: which, the metric's value, and the bound it crossed."""

    check: str
    metric: str
    value: float
    limit: float
    detail: str

    def line(self) -> str:
        return f"{self.check}: {self.detail}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "metric": self.metric,
            "value": _jsonable(self.value),
            "limit": _jsonable(self.limit),
            "detail": self.detail,
        }


@dataclass(frozen=True)
class GuardSettings:
    """The guard's flags (vime_core/config/schema.py, `run guard`); None: that check is off."""

    nonfinite: bool = True
    grad_norm_factor: Optional[float] = None
    grad_norm_floor: float = 0.0  # clip_grad: a norm at or below it is never a spike
    entropy_min: Optional[float] = None
    entropy_drop: Optional[float] = None
    k3_max: Optional[float] = None
    reward_failure_share: Optional[float] = None
    aborted_share: Optional[float] = None
    reward_drop: Optional[float] = None
    window: int = 20
    warmup: int = 5
    samples_per_group: int = 1

    @classmethod
    def of(cls, cfg: Any) -> "GuardSettings":
        return cls(
            nonfinite=bool(cfg.guard_nonfinite),
            grad_norm_factor=cfg.guard_grad_norm_factor,
            grad_norm_floor=float(cfg.clip_grad or 0.0),
            entropy_min=cfg.guard_entropy_min,
            entropy_drop=cfg.guard_entropy_drop,
            # off-policy (async_staleness > 0) the trainer has moved past the weights the engines
            # sampled with: the mismatch then measures that lag by design, not a fault
            k3_max=cfg.guard_k3_max if not cfg.async_staleness else None,
            reward_failure_share=cfg.guard_reward_failure_share,
            aborted_share=cfg.guard_aborted_share,
            reward_drop=cfg.guard_reward_drop,
            window=cfg.guard_window,
            warmup=cfg.guard_warmup,
            samples_per_group=cfg.n_samples_per_prompt,
        )


@dataclass(frozen=True)
class History:
    """The running values of the accepted records before a rollout id (module docstring's H)."""

    grad_norms: tuple[float, ...] = ()
    rewards: tuple[float, ...] = ()
    reward_stds: tuple[float, ...] = ()
    last_entropy: Optional[float] = None
    accepted: int = 0
    rollout_ids: tuple[int, ...] = field(default=(), compare=False)

    @classmethod
    def of(cls, records: Iterable[Mapping[str, Any]], before: int, window: int) -> "History":
        """H for rollout `before`: the records of lower rollout ids that did not breach, the last
        `window` of them (records as read_records returns them: one per rollout id, in order)."""
        kept = [r for r in records if r.get("rollout_id", before) < before and not r.get("guard_breaches")]
        kept = sorted(kept, key=lambda r: r["rollout_id"])[-window:] if window > 0 else []

        def finite(key: str) -> tuple[float, ...]:
            return tuple(float(r[key]) for r in kept if _finite(r.get(key)))

        entropies = finite("entropy")
        return cls(
            grad_norms=finite("grad_norm"),
            rewards=finite("reward_mean"),
            reward_stds=finite("reward_std"),
            last_entropy=entropies[-1] if entropies else None,
            accepted=len(kept),
            rollout_ids=tuple(r["rollout_id"] for r in kept),
        )

    def as_dict(self) -> dict[str, Any]:
        """The running values a breach is judged against, for its record."""
        return {
            "grad_norm_median": _median(self.grad_norms),
            "reward_mean_median": _median(self.rewards),
            "reward_std_median": _median(self.reward_stds),
            "entropy_before": self.last_entropy,
            "accepted_records": self.accepted,
        }


def metric_view(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout's metrics under the record's names (`rollout/reward_mean` -> `reward_mean`)."""
    return {k.removeprefix("rollout/"): v for k, v in metrics.items()}


def rollout_breaches(settings: GuardSettings, history: History, metrics: Mapping[str, Any]) -> list[Breach]:
    """The checks of the rollout's metrics (record names or `rollout/` ones), before training."""
    m = metric_view(metrics)
    out: list[Breach] = []
    if settings.nonfinite:
        out += _nonfinite(m, ROLLOUT_NONFINITE)
    share = settings.reward_failure_share
    if share is not None and _finite(m.get("reward_failure_share")) and m["reward_failure_share"] > share:
        value = float(m["reward_failure_share"])
        out.append(
            Breach(
                REWARD_FAILURES,
                "reward_failure_share",
                value,
                share,
                f"{value:.1%} of reward calls failed ({int(m.get('reward_failed_count') or 0)} samples) > "
                f"guard_reward_failure_share={share:g}",
            )
        )
    aborted = aborted_share(m, settings.samples_per_group)
    if settings.aborted_share is not None and aborted is not None and aborted > settings.aborted_share:
        out.append(
            Breach(
                ABORTED,
                "aborted_share",
                aborted,
                settings.aborted_share,
                f"{aborted:.1%} of submitted samples were aborted ({int(m.get('aborted_count') or 0)}) > "
                f"guard_aborted_share={settings.aborted_share:g}",
            )
        )
    drop = settings.reward_drop
    if drop is not None and history.accepted >= settings.warmup and _finite(m.get("reward_mean")) and history.rewards:
        median = _median(history.rewards)
        scale = max(abs(median), _median(history.reward_stds) or 0.0)
        fall = median - float(m["reward_mean"])
        if scale > 0 and fall > drop * scale:
            out.append(
                Breach(
                    REWARD_DROP,
                    "reward_mean",
                    float(m["reward_mean"]),
                    median - drop * scale,
                    f"reward_mean {float(m['reward_mean']):.4g} fell {fall:.4g} below its running median "
                    f"{median:.4g} (> guard_reward_drop={drop:g} x {scale:.4g})",
                )
            )
    return out


def train_breaches(settings: GuardSettings, history: History, metrics: Mapping[str, Any]) -> list[Breach]:
    """The checks of the trainer's metrics (MegatronTrainer.train's keys), before the publish."""
    out: list[Breach] = []
    if settings.nonfinite:
        out += _nonfinite(metrics, TRAIN_NONFINITE_ALWAYS)
        if not (metrics.get("skipped_steps") or 0):
            out += _nonfinite(metrics, TRAIN_NONFINITE_UNSKIPPED)
    factor, norm = settings.grad_norm_factor, metrics.get("grad_norm")
    if factor is not None and history.accepted >= settings.warmup and history.grad_norms and _finite(norm):
        median = _median(history.grad_norms)
        limit = max(factor * median, settings.grad_norm_floor)
        if norm > limit:
            out.append(
                Breach(
                    GRAD_NORM,
                    "grad_norm",
                    float(norm),
                    limit,
                    f"grad_norm {norm:.4g} > guard_grad_norm_factor={factor:g} x its running median {median:.4g}",
                )
            )
    entropy = metrics.get("entropy")
    if _finite(entropy):
        if settings.entropy_min is not None and entropy < settings.entropy_min:
            out.append(
                Breach(
                    ENTROPY_MIN,
                    "entropy",
                    float(entropy),
                    settings.entropy_min,
                    f"entropy {entropy:.4g} < guard_entropy_min={settings.entropy_min:g}",
                )
            )
        before, drop = history.last_entropy, settings.entropy_drop
        if drop is not None and before is not None and before > 0 and entropy < (1 - drop) * before:
            out.append(
                Breach(
                    ENTROPY_DROP,
                    "entropy",
                    float(entropy),
                    (1 - drop) * before,
                    f"entropy fell from {before:.4g} to {entropy:.4g} in one iteration "
                    f"(> guard_entropy_drop={drop:g} of it)",
                )
            )
    k3 = metrics.get("train_rollout_k3_kl")
    if settings.k3_max is not None and _finite(k3) and k3 > settings.k3_max:
        out.append(
            Breach(
                K3,
                "train_rollout_k3_kl",
                float(k3),
                settings.k3_max,
                f"train/rollout log-prob mismatch KL(k3) {k3:.4g} > guard_k3_max={settings.k3_max:g}",
            )
        )
    return out


def aborted_share(metrics: Mapping[str, Any], samples_per_group: int) -> Optional[float]:
    """Aborted samples over the samples submitted (groups x n_samples_per_prompt); None when the
    rollout's metrics do not count them."""
    aborted, groups = metrics.get("aborted_count"), metrics.get("submitted_groups")
    if not _finite(aborted) or not _finite(groups) or groups <= 0:
        return None
    return float(aborted) / (float(groups) * max(1, samples_per_group))


def breach_message(rollout_id: int, breaches: Sequence[Breach]) -> str:
    """The one line of a breach: `run guard stopped rollout 7: grad-norm: grad_norm 53 > ...`."""
    return f"run guard stopped rollout {rollout_id}: " + "; ".join(b.line() for b in breaches)


def margins(records: Iterable[Mapping[str, Any]], settings: GuardSettings) -> dict[str, dict[str, Any]]:
    """Per check, how close a run's accepted records came to firing it: the worst value the check
    saw and its bound at that iteration (the defaults are measured with this on the default job)."""
    records = sorted(records, key=lambda r: r["rollout_id"])
    worst: dict[str, dict[str, Any]] = {}

    def note(check: str, rollout_id: int, value: float, limit: float, ratio: float) -> None:
        if check not in worst or ratio > worst[check]["ratio"]:
            worst[check] = {"rollout_id": rollout_id, "value": value, "limit": limit, "ratio": ratio}

    for rec in records:
        k = rec["rollout_id"]
        h = History.of(records, k, settings.window)
        if _finite(rec.get("grad_norm")) and h.accepted >= settings.warmup and h.grad_norms:
            median = _median(h.grad_norms)
            if median > 0 and settings.grad_norm_factor:
                limit = max(settings.grad_norm_factor * median, settings.grad_norm_floor)
                note(GRAD_NORM, k, rec["grad_norm"], limit, rec["grad_norm"] / limit)
        entropy = rec.get("entropy")
        if _finite(entropy):
            if settings.entropy_min:
                note(ENTROPY_MIN, k, entropy, settings.entropy_min, settings.entropy_min / max(entropy, 1e-12))
            if settings.entropy_drop and h.last_entropy:
                fall = 1 - entropy / h.last_entropy
                note(ENTROPY_DROP, k, fall, settings.entropy_drop, fall / settings.entropy_drop)
        if _finite(rec.get("train_rollout_k3_kl")) and settings.k3_max:
            note(K3, k, rec["train_rollout_k3_kl"], settings.k3_max, rec["train_rollout_k3_kl"] / settings.k3_max)
        if _finite(rec.get("reward_failure_share")) and settings.reward_failure_share:
            share = rec["reward_failure_share"]
            note(REWARD_FAILURES, k, share, settings.reward_failure_share, share / settings.reward_failure_share)
        aborted = aborted_share(rec, settings.samples_per_group)
        if aborted is not None and settings.aborted_share:
            note(ABORTED, k, aborted, settings.aborted_share, aborted / settings.aborted_share)
        if _finite(rec.get("reward_mean")) and settings.reward_drop and h.accepted >= settings.warmup and h.rewards:
            median = _median(h.rewards)
            scale = max(abs(median), _median(h.reward_stds) or 0.0)
            if scale > 0:
                fall = (median - rec["reward_mean"]) / scale
                note(REWARD_DROP, k, fall, settings.reward_drop, fall / settings.reward_drop)
    return worst


def _nonfinite(metrics: Mapping[str, Any], keys: Sequence[str]) -> list[Breach]:
    bad = [k for k in keys if isinstance(metrics.get(k), (int, float)) and not math.isfinite(metrics[k])]
    if not bad:
        return []
    what = ", ".join(f"{k}={metrics[k]}" for k in bad)
    return [Breach(NONFINITE, bad[0], float(metrics[bad[0]]), math.inf, f"{what} (guard_nonfinite)")]


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _median(xs: Sequence[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def _jsonable(x: float) -> Any:
    """JSON has no NaN or Inf: such a value is written as its name."""
    return x if math.isfinite(x) else str(x)
