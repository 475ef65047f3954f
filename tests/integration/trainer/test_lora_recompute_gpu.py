"""LoRA under Megatron's full activation recompute, on CUDA: the recompute is a reentrant autograd
Function whose output gets a gradient only when one of its inputs has one, and with LoRA the
embedding is frozen (vime_core/trainer/lora.apply_lora makes the embedding's output require a
gradient). The CPU test (tests/unit/test_lora.py) stands a reentrant torch checkpoint in for it;
this one runs Megatron's own (recompute_granularity=full exists only on GPUs). Runs only where
CUDA is."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.lora_workers import recompute_train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: Megatron's full recompute runs only there (the CPU test: tests/unit/test_lora.py)",
    ),
]


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen2", False)


def test_lora_trains_every_adapter_under_full_recompute(ckpt, tmp_path):
    """Two optimizer steps of one rollout with every layer recomputed: every adapter moves, the
    frozen base does not, and the loss is the one the same adapters give without recompute. Each
    run in its own process (NCCL; the session's single_rank group is gloo)."""
    runs = {}
    for recompute in ("", "full"):
        out = tmp_path / f"{recompute or 'none'}.pt"
        spawn(recompute_train, 1, str(ckpt), str(tmp_path / (recompute or "none")), recompute, str(out))
        run = torch.load(out, weights_only=False)
        before, after, trainable = run["before"], run["after"], run["trainable"]
        assert trainable and all("lora" in n for n in trainable)
        b = [n for n in trainable if n.endswith("lora.B")]  # zero at start: only a gradient moves it
        assert b and all(not torch.equal(after[n], before[n]) for n in b), recompute
        assert all(torch.equal(after[n], before[n]) for n in after if n not in trainable), recompute
        assert run["optimizer_steps"] == 2
        runs[recompute] = run
    # the same math, the activations made again in the backward pass: bf16's noise only
    assert runs["full"]["loss"] == pytest.approx(runs[""]["loss"], rel=2e-2, abs=1e-3)
