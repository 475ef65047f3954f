"""The driver (`vime train`, its flows and tasks) imports no torch, transformers, megatron or vllm:
they cost the command seconds of start-up and belong to the trainer's and the engines' processes.
An import moved to the top of a module the driver reaches brings them in unseen; this test sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER_MODULES = ["flows.cli", "flows.train", "flows.iteration", "flows.replay", "flows.teardown", "tasks.bootstrap"]
HEAVY = ["torch", "transformers", "megatron", "vllm"]


def test_the_driver_imports_no_trainer_or_engine_library():
    probe = (
        "import importlib, json, sys\n"
        f"for m in {DRIVER_MODULES!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"the driver imported {out.stdout.strip()}"
