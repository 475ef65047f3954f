"""The prompt files of this folder, made deterministically (a unit test checks the committed files
are what this writes):

    .venv/bin/python -m recipes.tool_use.prompts      # rewrites prompts_tiny.jsonl, prompts_gpu.jsonl

prompts_tiny.jsonl: bare expressions of three one-digit numbers ("3*4+5"), in the tiny model's
alphabet. prompts_gpu.jsonl: expressions of three or four numbers of up to three digits, inside an
instruction that explains the calculator's protocol to a chat model (calculator.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from recipes.tool_use.calculator import evaluate

HERE = Path(__file__).resolve().parent
TINY, GPU = HERE / "prompts_tiny.jsonl", HERE / "prompts_gpu.jsonl"
OPERATORS = "+-*"

INSTRUCTION = (
    "Compute {expression}. A calculator is available: write integers joined by +, - or * and then '=' "
    "(e.g. 37*48=) and it writes the value after the '='; a value can be continued (37*48=1776+125=). "
    "Finish with '>' and the final number."
)


def expression(rng: random.Random, numbers: int, max_value: int) -> str:
    parts = [str(rng.randint(0, max_value))]
    for _ in range(numbers - 1):
        parts += [rng.choice(OPERATORS), str(rng.randint(0, max_value))]
    return "".join(parts)


def tiny_rows(count: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    exprs = [expression(rng, 3, 9) for _ in range(count)]
    return [{"prompt_id": f"calc-{i}", "prompt": e, "label": str(evaluate(e))} for i, e in enumerate(exprs)]


def gpu_rows(count: int = 256, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        e = expression(rng, rng.choice((3, 4)), 999)
        rows.append({"prompt_id": f"calc-{i}", "prompt": INSTRUCTION.format(expression=e), "label": str(evaluate(e))})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def main() -> None:
    TINY.write_text(render(tiny_rows()))
    GPU.write_text(render(gpu_rows()))


if __name__ == "__main__":
    main()
