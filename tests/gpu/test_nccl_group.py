"""The `nccl` carrier of the broadcast weight transport on real GPUs, without vLLM
(tests/gpu/check_nccl_group.py in a process of its own, so CUDA state does not leak between
checks): vime's ctypes bindings form a group, broadcast and close; an init whose peer never
joins gives up at its deadline and leaves the GPU usable; with two GPUs the bytes arrive."""

from __future__ import annotations

import json
import sys

import pytest

from tests.gpu.scripts import run_script

pytestmark = pytest.mark.integration

CHECK = "tests/gpu/check_nccl_group.py"


def _check(*args: str) -> dict:
    proc = run_script([sys.executable, CHECK, *args], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu(gpus=1)
def test_group_of_one_initialises_broadcasts_and_closes():
    result = _check("--bytes", str(64 << 20), "--repeats", "2")
    assert result["ok"] and result["init_s"] > 0 and len(result["broadcast_s"]) == 2


@pytest.mark.gpu(gpus=1)
def test_init_without_its_peer_gives_up_at_the_deadline():
    result = _check("--bytes", str(1 << 20), "--repeats", "1", "--init-timeout", "10")
    no_peer = result["no_peer"]
    assert no_peer["raised"] and no_peer["raised"].startswith("TimeoutError"), no_peer
    assert no_peer["seconds"] < 15 and no_peer["group_of_one_after"], no_peer


@pytest.mark.gpu(gpus=2)
def test_broadcast_reaches_every_other_gpu_intact():
    result = _check("--bytes", str(256 << 20), "--repeats", "3")
    assert result["gpus"] >= 2 and result["receivers"] and result["ok"], result
