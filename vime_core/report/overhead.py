"""Orchestration overhead of a run's iterations.

    compute_k  = rollout generate + build (RolloutManager) + batch write (Ray task next to the
                 data) + train (MegatronTrainer) + weight publish (rank 0), all measured inside
                 the actors
    overhead   = sum_k wall_k - sum_k compute_k        over a window of iterations
    fraction   = overhead / sum_k wall_k

wall_k is the iteration flow run's wall time as its caller sees it (flow-run start and end
included). Sums, not per-iteration ratios: with rollout_prefetch part of rollout k+1 runs
inside wall_k, and over a window the part entering at its end and the part leaving at its start
cancel. The window drops the first iteration (warm-up) and the last (it starts no next rollout).
"""

from __future__ import annotations

COMPUTE_KEYS = ("time_total_s", "time_build_s", "t_write_s", "train_time_s", "publish_s")


def compute_seconds(record: dict) -> float:
    return sum(float(record.get(k) or 0.0) for k in COMPUTE_KEYS)


def overhead(walls: list[float], records: list[dict]) -> dict:
    """{"window", "mean_wall_s", "mean_compute_s", "mean_overhead_s", "fraction"} over the
    steady window of paired (wall, record) iterations."""
    pairs = list(zip(walls, records))
    window = pairs[1:-1] if len(pairs) > 3 else pairs
    if not window:
        return {"window": 0, "mean_wall_s": None, "mean_compute_s": None, "mean_overhead_s": None, "fraction": None}
    wall = sum(w for w, _ in window)
    compute = sum(compute_seconds(r) for _, r in window)
    n = len(window)
    return {"window": n, "mean_wall_s": wall / n, "mean_compute_s": compute / n,
            "mean_overhead_s": (wall - compute) / n, "fraction": (wall - compute) / wall}
