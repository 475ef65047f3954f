"""The on-policy distillation teacher in the trainer (use_opd, opd_type=megatron): one of another
architecture (Llama, three layers, untied head) with the student's vocabulary is built as its
own model, and the step's opd_reverse_kl is transformers' log pi_student - log pi_teacher of the
sampled tokens; a teacher of another vocabulary stops init naming its config.json."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer


@pytest.fixture(scope="module")
def student(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen3", True)


@pytest.fixture(scope="module")
def teacher(cache_dir):
    from vime_core.demo.model import build_tiny_model

    return build_tiny_model(
        cache_dir / "models" / "teacher-llama-3-layers",
        family="llama",
        seed=2,
        tie_word_embeddings=False,
        num_heads=4,
        num_kv_heads=2,
        num_layers=3,
    )


@torch.no_grad()
def _hf_log_probs(path, batch) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    for tokens, n in zip(batch["tokens"], batch["response_length"]):
        x = torch.tensor([tokens])
        out.append(model(input_ids=x).logits[0, -n - 1 : -1].log_softmax(-1).gather(1, x[0, -n:, None])[:, 0])
    return out


def test_a_teacher_of_another_architecture_scores_the_students_tokens(single_rank, student, teacher, tmp_path):
    from vime_core.trainer.train_step import forward_log_probs

    cfg = hand_config(
        student, tmp_path, use_opd=True, opd_type="megatron", opd_teacher_load=str(teacher), num_steps_per_rollout=1
    )
    trainer = single_rank_trainer(cfg)
    assert trainer.teacher_model is not None and trainer.teacher_model is not trainer.model
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    batch = hand_batch()
    ours = forward_log_probs(trainer.teacher_model, batch, [[0, 1, 2, 3]], trainer.arch.vocab_size, 1.0, "cpu")
    theirs = _hf_log_probs(teacher, batch)
    for i, expected in enumerate(theirs):
        assert ours[i].tolist() == pytest.approx(expected.tolist(), abs=1e-4)

    students = _hf_log_probs(student, batch)
    reverse_kl = torch.cat([s - t for s, t in zip(students, theirs)])
    metrics = trainer.train(0, batch)
    assert metrics["opd_reverse_kl"] == pytest.approx(reverse_kl.mean().item(), abs=1e-4)
    assert trainer.sleep()["freed_bytes"] == 0  # a no-op on the CPU, teacher included


def test_a_teacher_of_another_vocabulary_stops_init_naming_its_config(single_rank, student, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(student, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 40}))
    cfg = hand_config(student, tmp_path, use_opd=True, opd_type="megatron", opd_teacher_load=str(other))
    with pytest.raises(ValueError, match=rf"{other / 'config.json'} has vocab_size=40"):
        single_rank_trainer(cfg)
