"""The embedded default task: single-digit addition, "a+b=" -> "c" then EOS, a and b in 0..4; reward 1.0
when the response is exactly the sum followed by EOS, else 0.0. The answer depends on the prompt, and
a freshly initialised tiny model learns it from the binary reward alone, so the default job shows a
real reward curve on CPU cores (docs/measurements.md)."""

from __future__ import annotations

import json
import random
from pathlib import Path

MAX_OPERAND = 4


def make_rows(max_operand: int = MAX_OPERAND) -> list[dict]:
    return [
        {"prompt_id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "label": str(a + b)}
        for a in range(max_operand + 1)
        for b in range(max_operand + 1)
    ]


def write_dataset(path: str | Path, seed: int = 0, max_operand: int = MAX_OPERAND) -> Path:
    """JSONL with one row per (a, b); rows are shuffled with `seed` so files are reproducible."""
    path = Path(path)
    rows = make_rows(max_operand)
    random.Random(seed).shuffle(rows)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def reward(sample) -> float:
    """1.0 iff the generated text is the label and generation stopped on EOS (not truncated)."""
    finished = sample.finish_reason == "stop"
    return 1.0 if finished and sample.response.strip() == str(sample.label) else 0.0
