"""The on-policy distillation teacher's checkpoint check (use_opd, opd_type=megatron): the teacher scores
the student's token ids, so its vocab_size and tokenizer vocabulary must equal the student's; its
architecture may differ."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from vime_core.trainer.model import read_hf_config

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model", "tokenizer_config.json")


def tokenizer_file(folder: Path) -> Path | None:
    """The file that holds the checkpoint's vocabulary (the first of TOKENIZER_FILES there)."""
    return next((folder / name for name in TOKENIZER_FILES if (folder / name).is_file()), None)


def check_teacher_checkpoint(student: str | Path, teacher: str | Path) -> dict[str, Any]:
    """The teacher's HF config after checking its vocabulary against the student's (module
    docstring); FileNotFoundError or ValueError naming the teacher's file otherwise."""
    student, teacher = Path(student), Path(teacher)
    config = teacher / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"opd_teacher_load={str(teacher)!r}: no HF checkpoint there ({config} missing)")
    teacher_cfg, student_cfg = read_hf_config(teacher), read_hf_config(student)
    if teacher_cfg.get("vocab_size") != student_cfg.get("vocab_size"):
        raise ValueError(
            f"opd_teacher_load: {config} has vocab_size={teacher_cfg.get('vocab_size')}, the student "
            f"({student / 'config.json'}) {student_cfg.get('vocab_size')}; the teacher scores the "
            f"student's token ids, so it needs the student's vocabulary"
        )
    teacher_file = tokenizer_file(teacher)
    if teacher_file is None:
        raise FileNotFoundError(
            f"opd_teacher_load={str(teacher)!r}: no tokenizer there (none of "
            f"{', '.join(TOKENIZER_FILES)}); the teacher must carry the student's tokenizer"
        )
    teacher_vocab = AutoTokenizer.from_pretrained(str(teacher)).get_vocab()
    student_vocab = AutoTokenizer.from_pretrained(str(student)).get_vocab()
    if teacher_vocab != student_vocab:
        differ = sorted(set(teacher_vocab.items()) ^ set(student_vocab.items()), key=lambda kv: kv[1])[:3]
        raise ValueError(
            f"opd_teacher_load: the tokenizer of {teacher_file} ({len(teacher_vocab)} tokens) is not "
            f"the student's ({tokenizer_file(student) or student}, {len(student_vocab)} tokens); first "
            f"differences (token, id): {differ}"
        )
    return teacher_cfg
