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


def test_the_headline_names_every_measured_mode_and_the_base_trees_commit():
    """bench/run.py's line for a startup row: each mode's median and its ratio, the `base` mode
    (another checkout) by the commit it ran."""
    run = load_bench("run.py", "bench_run")
    medians = {"early": 24.0, "base": 30.0, "early_again": 25.0}
    row = {
        "startup_s_median": medians,
        "repeats": 3,
        "base_tree_sha": "abc1234",
        **{f"ratio_early_over_{m}": medians["early"] / medians[m] for m in ("base", "early_again")},
    }
    line = run._startup(row)
    assert "at abc1234 30.0 s (ratio 0.80)" in line and "the same again (A/A) 25.0 s (ratio 0.96)" in line
