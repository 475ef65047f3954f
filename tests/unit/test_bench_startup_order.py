"""The startup bench's rounds rotate the modes: over as many rounds as modes, each mode runs once
in each position, so an order effect falls on every mode alike."""

from __future__ import annotations

from tests.bench_scripts import load_bench


def test_each_mode_takes_each_position_once_over_as_many_rounds():
    bench = load_bench("bench_startup.py", "bench_startup")
    modes = ["early", "early_again", "early_ray_metrics_off"]
    rounds = [bench.round_order(modes, i) for i in range(len(modes))]
    assert all(sorted(r) == sorted(modes) for r in rounds)  # every round runs every mode once
    for position in range(len(modes)):
        assert sorted(r[position] for r in rounds) == sorted(modes)
    assert rounds[0] == modes and bench.round_order(modes, len(modes)) == modes
