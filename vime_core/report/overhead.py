"""Orchestration overhead of a run's iterations: everything vime adds around the work measured inside
the actors (Prefect runs, Ray calls and transfers, the report, persist where not hidden).

    overhead = sum_k wall_k - sum_k compute_k,   fraction = overhead / sum_k wall_k

compute_k = rollout generate + build + train + rank 0's publish. Sums over a window (without the
first and the last iteration), because a prefetched rollout k+1 runs inside wall_k."""

from __future__ import annotations

# phase -> the record keys (measured inside the actors) that make up its compute
COMPUTE_SPLIT = {
    "rollout": ("time_total_s", "time_build_s"),
    "train": ("train_time_s",),
    "sync": ("publish_s",),
}


def compute_split(record: dict) -> dict[str, float]:
    return {phase: sum(float(record.get(k) or 0.0) for k in keys) for phase, keys in COMPUTE_SPLIT.items()}


def compute_seconds(record: dict) -> float:
    return sum(compute_split(record).values())


def steady_window(items: list) -> list:
    """Iterations 1..N-2 (all of them for 3 or fewer)."""
    return items[1:-1] if len(items) > 3 else items


def overhead(walls: list[float], records: list[dict]) -> dict:
    """{"window", "mean_wall_s", "mean_compute_s", "mean_overhead_s", "fraction"} over the
    steady window of paired (wall, record) iterations."""
    window = steady_window(list(zip(walls, records)))
    if not window:
        return {"window": 0, "mean_wall_s": None, "mean_compute_s": None, "mean_overhead_s": None, "fraction": None}
    wall = sum(w for w, _ in window)
    compute = sum(compute_seconds(r) for _, r in window)
    n = len(window)
    return {
        "window": n,
        "mean_wall_s": wall / n,
        "mean_compute_s": compute / n,
        "mean_overhead_s": (wall - compute) / n,
        "fraction": (wall - compute) / wall,
    }
