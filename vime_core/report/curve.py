"""The reward-curve picture of a run (PNG), written next to its metrics."""

from __future__ import annotations

import io

from vime_core.report.records import REWARD_CURVE, report_location


def _pyplot():
    # boundary: the driver imports this module at start; matplotlib (heavy) loads in preload() or the first curve
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # boundary: as matplotlib above, and after choosing the Agg backend

    return plt


def preload() -> None:
    """Import matplotlib now (once per process, and slow), so the first
    reward curve an iteration draws costs only the drawing: the report ends an
    iteration flow run, and with rollout_prefetch its time is hidden only while it is shorter
    than the next rollout. In the caller's thread, not in the background: CPython before 3.11.8
    keeps the AST constructor's recursion depth in global state (gh-106905), so an import in a
    background thread could make a concurrent one that parses source fail (torch's did, with
    "AST constructor recursion depth mismatch")."""
    _pyplot()


def reward_curve_png(records: list[dict], title: str) -> bytes:
    plt = _pyplot()

    ids = [r["rollout_id"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(ids, [r.get("reward_mean") for r in records], marker=".", label="reward mean")
    if any(r.get("eval_reward_mean") is not None for r in records):
        ev = [(r["rollout_id"], r["eval_reward_mean"]) for r in records if r.get("eval_reward_mean") is not None]
        ax.plot([e[0] for e in ev], [e[1] for e in ev], marker="o", label="eval reward")
    ax.set_xlabel("rollout id")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_reward_curve(storage_uri: str, run_name: str, png: bytes, endpoint=None) -> str:
    """Replace the run's reward_curve.png (one atomic write); returns its path or URI."""
    reports = report_location(storage_uri, run_name, endpoint)
    reports.put_atomic(REWARD_CURVE, png)
    return reports.url(REWARD_CURVE)
