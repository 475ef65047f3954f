"""A colocated run on one GPU survives what a scheduler or a neighbour does to it.

One run (bench/gpu/run_colocated_h200.sh, a random 0.5B model, engine and trainer sleeping
between phases) is started for the module and kept up (KEEP_ACTORS=1); each check then takes it
two iterations further from wherever it stands, so the checks run in any order:

- a second run whose engine asks for more memory than the first one's awake engine leaves is
  refused at start, naming the setting and the free memory, and stores nothing;
- the driver SIGKILLed while the engines sleep (onload-weights-K), or at the publish (sync-vN):
  the same command wakes the engines, publishes the trainer's weights again and goes on;
- another process takes the GPU's memory while the engine sleeps: the wake fails with the engine
  named, and once the memory is back the same command restarts the engine and goes on;
- SIGTERM to the driver's session while the trainer trains: exit 143 within the grace period,
  with the resume hint, the train task not retried; the same command resumes.

The checks are tests/gpu/check_memory_refusal.sh and tests/gpu/check_stopped_asleep.sh (their
headers say what each asserts); each writes its verdict as JSON, asserted here. Needs the GPU
host's bundle in $PARTS (default /tmp/parts).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.gpu.scripts import run_script

pytestmark = [pytest.mark.e2e, pytest.mark.gpu(gpus=1)]

WORK = Path(os.environ.get("VIME_GPU_WORK", "/tmp/vime-gpu"))


@pytest.fixture(scope="module")
def colocated_run(tmp_path_factory):
    parts = Path(os.environ.get("PARTS", "/tmp/parts"))
    if not (parts / "install_bundle.sh").exists():
        pytest.skip(f"needs the GPU host's bundle of pinned wheels in {parts} ($PARTS, with its install_bundle.sh)")
    env = {
        "RUN_NAME": f"gpu-checks-{int(time.time())}",
        "VIME_GPU_WORK": str(WORK),
        "KEEP_ACTORS": "1",
        "TRAIN_TIMEOUT": "480",
        "OUT": str(tmp_path_factory.mktemp("run")),
    }
    proc = run_script(["bash", "bench/gpu/run_colocated_h200.sh", "2"], env, timeout=900)
    assert proc.returncode == 0 and iterations_done(env) == 2, proc.stdout[-3000:]
    yield env
    run_script(
        [
            "bash",
            "-c",
            'export PYTHONPATH=/tmp/site-trainer:$PWD; python3 -m flows.cli teardown --run-name "$RUN_NAME";'
            " python3 -m flows.cli cluster down",
        ],
        env,
        timeout=300,
    )


def iterations_done(env: dict) -> int:
    path = WORK / "runs" / "reports" / env["RUN_NAME"] / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return max((r["rollout_id"] for r in records), default=-1) + 1


def stop_and_resume(run: dict, tmp_path: Path, verdict: str, **env: str) -> dict:
    """check_stopped_asleep.sh from the run's current iteration K to K + 2; its verdict JSON."""
    k = iterations_done(run)
    # iteration k publishes version k + 2: PAUSE_AT="sync-v{version}"
    env = {**run, "OUT": str(tmp_path), **{key: value.format(k=k, version=k + 2) for key, value in env.items()}}
    proc = run_script(["bash", "tests/gpu/check_stopped_asleep.sh", str(k), str(k + 2)], env, timeout=1200)
    assert (tmp_path / verdict).exists(), proc.stdout[-3000:]
    return json.loads((tmp_path / verdict).read_text())


def test_an_engine_asking_for_more_memory_than_is_free_is_refused_at_start(colocated_run, tmp_path):
    proc = run_script(
        ["bash", "tests/gpu/check_memory_refusal.sh"],
        {**colocated_run, "OUT": str(tmp_path), "REFUSAL_TIMEOUT": "420"},
        timeout=600,
    )
    assert (tmp_path / "memory_refusal.json").exists(), proc.stdout[-3000:]
    result = json.loads((tmp_path / "memory_refusal.json").read_text())
    assert result["refused_cleanly"], result


def test_a_driver_killed_while_the_engines_sleep_resumes(colocated_run, tmp_path):
    result = stop_and_resume(colocated_run, tmp_path, "stopped_asleep.json", HARM="kill")
    assert result["ok"], result


def test_a_driver_killed_at_the_publish_resumes(colocated_run, tmp_path):
    result = stop_and_resume(colocated_run, tmp_path, "stopped_asleep.json", HARM="kill", PAUSE_AT="sync-v{version}")
    assert result["ok"], result


def test_an_engine_whose_wake_runs_out_of_memory_is_restarted(colocated_run, tmp_path):
    result = stop_and_resume(colocated_run, tmp_path, "wake_failure.json", HARM="hog", FAIL_TIMEOUT="150")
    assert result["ok"], result


def test_a_driver_stopped_by_sigterm_while_training_exits_and_resumes(colocated_run, tmp_path):
    result = stop_and_resume(colocated_run, tmp_path, "stopped_by_sigterm.json", HARM="term")
    assert result["ok"], result
