"""bench/gpu/largest_dense.py on the CPU (issue 43's largest shape): the bisection finds the largest
fitting layer count of every monotone case in few probes, the sleeping engine's memory comes from
the recorded colocated rows, NAME@L shapes count their layers, and one real probe runs
bench_trainer_gpu.py's step on a tiny NAME@L shape."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
largest = load_bench("gpu/largest_dense.py", "bench_largest_dense")
gpu_common = sys.modules["gpu_common"]


@pytest.mark.parametrize("lo,hi", [(1, 1), (14, 36), (3, 10)])
def test_bisection_finds_the_largest_fitting_layers_of_every_threshold(lo, hi):
    for threshold in range(lo - 1, hi + 1):  # fits up to `threshold` layers (lo - 1: none fits)
        asked: list[int] = []

        def fits(layers: int) -> bool:
            asked.append(layers)
            return layers <= threshold

        got = largest.largest_fitting(lo, hi, fits)
        assert got == (threshold if threshold >= lo else None), (lo, hi, threshold)
        assert len(asked) == len(set(asked))  # no candidate probed twice
        assert len(asked) <= 2 + math.ceil(math.log2(max(hi - lo, 1))), asked


def test_the_sleeping_engine_memory_is_the_most_any_recorded_run_held(tmp_path):
    def row(*held):
        memory = [
            {"rollout_id": i, "engines_after_offload_rollout": {"device_used_gib": h}} for i, h in enumerate(held)
        ]
        return json.dumps({"figures": {"memory": memory}})

    rows = tmp_path / "colocated.jsonl"
    rows.write_text("\n".join([row(2.5, 3.4), json.dumps({"figures": {}}), row(1.0)]) + "\n")
    assert largest.engine_asleep_gib(rows) == 3.4
    # the committed rows hold such records
    assert largest.engine_asleep_gib() > 0
    (tmp_path / "none.jsonl").write_text(json.dumps({"figures": {}}) + "\n")
    with pytest.raises(SystemExit, match="--engine-asleep-gib"):
        largest.engine_asleep_gib(tmp_path / "none.jsonl")


def test_a_shape_at_l_layers_counts_l_layers():
    per_layer = (
        gpu_common.parameter_counts(gpu_common.hf_config("8b@2"))["total"]
        - gpu_common.parameter_counts(gpu_common.hf_config("8b@1"))["total"]
    )
    assert gpu_common.parameter_counts(gpu_common.hf_config("8b@36")) == gpu_common.parameter_counts(
        gpu_common.hf_config("8b")
    )
    assert gpu_common.parameter_counts(gpu_common.hf_config("8b@20"))["total"] == (
        gpu_common.parameter_counts(gpu_common.hf_config("8b"))["total"] - 16 * per_layer
    )
    for bad in ("8b@0", "8b@x", "9b", "8b@"):
        assert not gpu_common.is_shape(bad), bad
    with pytest.raises(ValueError, match="NAME@LAYERS"):
        gpu_common.hf_config("9b@3")


def test_one_probe_runs_the_trainer_step_of_a_tiny_shape(tmp_path):
    a = argparse.Namespace(
        base="tiny",
        device="cpu",
        samples=4,
        prompt_len=8,
        response_len=8,
        variant="pack64",
        probe_timeout=300,
        work=tmp_path,
    )
    got = largest.probe(a, 3, None)
    assert got["exit"] == 0 and got["fits"], got
    assert (
        got["shape"] == "tiny@3"
        and got["params"] == gpu_common.parameter_counts(gpu_common.hf_config("tiny@3"))["total"]
    )
    assert got["step_time_s"] > 0 and not (tmp_path / "ckpt").exists()  # the checkpoint removed
    result = json.loads((tmp_path / "probe-3.json").read_text())
    assert result["shape"] == "tiny@3" and result["variants"][0]["variant"] == "pack64"
