"""bench/bench_trainer_gpu.py runs on the CPU at a tiny shape through the trainer's own entry
points (schedule, old log-probs, advantages, step): a change of their signatures breaks this
test, not the next GPU lease (the script records a failed variant as a result and goes on)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    "shape, variants",
    [("tiny", ["pack32768"]), ("tiny-moe", ["pack32768", "pack32768+seqexperts"])],  # MoE: grouped, then in turn
)
def test_the_trainer_bench_measures_a_step_on_the_cpu(tmp_path, shape, variants):
    out = tmp_path / "trainer.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "bench_trainer_gpu.py"),
        "--device",
        "cpu",
        "--shape",
        shape,
        "--checkpoint-root",
        str(tmp_path / "ckpt"),
        "--samples",
        "4",
        "--prompt-len",
        "16",
        "--response-len",
        "16",
        "--variants",
        ",".join(variants),
        "--warmup",
        "1",
        "--repeats",
        "1",
        "--check-steps",
        "0",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())["variants"]
    assert [v["variant"] for v in measured] == variants
    for variant in measured:
        assert "error" not in variant, variant
        assert variant["step_time_s"] > 0 and variant["logprob_time_s"] > 0 and variant["tokens_per_s"] > 0
