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


def test_the_driver_reuses_the_built_demo_model_without_torch(tmp_path):
    """`vime train` with no hf_checkpoint resolves to the embedded tiny model, built once: a later
    start finds it built and imports none of the libraries that build it."""
    probe = (
        "import json, sys\n"
        "from vime_core.demo.model import build_tiny_model\n"
        f"build_tiny_model({str(tmp_path / 'tiny')!r})\n"
        f"print(json.dumps(sorted(h for h in {HEAVY!r} if h in sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = [
        subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        for _ in range(2)
    ]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr[-2000:]
    built, reused = (r.stdout.strip().splitlines()[-1] for r in runs)
    assert "torch" in built and reused == "[]", (built, reused)


def test_creating_the_trainer_group_imports_no_trainer_library(ray_head, tiny_model_dir):
    """run_actors makes the trainer ranks' actors (bootstrap, `vime train`'s early start) without
    importing torch or Megatron: the actor's class (TrainerActor) builds MegatronTrainer in the
    actor's own process, which then answers by its trainer's methods."""
    probe = (
        "import json, sys\n"
        "from vime_core.cluster.connect import ensure_ray\n"
        "from vime_core.cluster.run_actors import get_or_create_placement_group, get_or_create_trainer_group, "
        "teardown\n"
        "from vime_core.config import make_config\n"
        "from vime_core.demo.settings import demo_values\n"
        f"cfg = make_config(demo_values({{'run_name': 'driver-imports', 'ray_address': {ray_head!r}, "
        f"'hf_checkpoint': {str(tiny_model_dir)!r}}}))\n"
        "ensure_ray(cfg.ray_address)\n"
        "try:\n"
        "    group, created = get_or_create_trainer_group(cfg, get_or_create_placement_group(cfg))\n"
        "    state = group.rank0('state')\n"
        f"    print(json.dumps([created, state['weight_version'], sorted(h for h in {HEAVY!r} if h in sys.modules)]))\n"
        "finally:\n"
        "    teardown(cfg.run_name, num_trainers=1)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[true, 0, []]", out.stdout[-2000:]
