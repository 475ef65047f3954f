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
from tests.integration.trainer.hand_batch import hand_batch, single_rank_trainer
from tests.integration.trainer.lora_workers import lora_config

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


def test_lora_trains_every_adapter_under_full_recompute(single_rank, ckpt, tmp_path):
    """Two optimizer steps of one rollout with every layer recomputed: every adapter moves, the
    frozen base does not, and the loss is the one the same adapters give without recompute."""
    runs = {}
    for recompute in (None, "full"):
        trainer = single_rank_trainer(
            lora_config(ckpt, tmp_path / str(recompute), device="cuda", bf16=True, recompute_granularity=recompute)
        )
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        metrics = trainer.train(0, hand_batch())
        after = dict(trainer.model.named_parameters())
        adapters = [n for n, p in after.items() if p.requires_grad]
        assert adapters and all("lora" in n for n in adapters)
        assert all(not torch.equal(after[n], before[n]) for n in adapters if n.endswith("lora_B.weight")), recompute
        assert all(torch.equal(p, before[n]) for n, p in after.items() if not p.requires_grad), recompute
        assert trainer.optimizer_steps == 2
        runs[recompute] = metrics
    # the same math, the activations made again in the backward pass: bf16's noise only
    assert runs["full"]["loss"] == pytest.approx(runs[None]["loss"], rel=2e-2, abs=1e-3)
