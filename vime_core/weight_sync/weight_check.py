"""Did the publish arrive? (`check_weight_update_equal`, as slime's --check-weight-update-equal.) The
trainer and every engine score one fixed seeded probe at temperature 1:

    max_abs_diff         = max_j |e_j - l_j|          small: the engine serves the trainer's weights
    changed_max          = max_j |e_j(v) - e_j(v-1)|  > 0: the weights did change
    trainer_changed_max  = max_j |l_j(v) - l_j(v-1)|

l_j the trainer's log p(x_j | x_<j), e_j vLLM's prompt log-probs. Both round to bf16 with different
kernels, so the difference is reported (bench/results), not asserted here: on large random-weight
shapes it exceeds what one step changes (docs/measurements.md). What is decisive whatever the noise:
an engine whose log-probs are exactly those of the previous version while the trainer's moved did
not receive the publish (`stale_engines`); scoring the same weights twice gives the same numbers."""

from __future__ import annotations

import random
from typing import Any, Optional, Sequence

PROBE_LENGTH = 64


def probe_length(max_context_len: int) -> int:
    """PROBE_LENGTH, or less where the engine's max_model_len leaves no room for it and the
    one token the request must generate."""
    return max(2, min(PROBE_LENGTH, max_context_len - 1))


def probe_tokens(vocab_size: int, seed: int, length: int = PROBE_LENGTH) -> list[int]:
    rng = random.Random(seed * 1_000_003 + 17)
    return [rng.randrange(vocab_size) for _ in range(length)]


def probe_batch(tokens: Sequence[int]) -> dict[str, list]:
    """The probe as a one-sample batch whose 'response' is every token after the first."""
    n = len(tokens) - 1
    return {"tokens": [list(tokens)], "response_length": [n], "loss_mask": [[1] * n]}


def prompt_logprobs_of(answer: dict, tokens: Sequence[int]) -> list[float]:
    """e_1 .. e_{n-1} from a `/inference/v1/generate` answer with `prompt_logprobs: 0`: entry j
    maps token ids (as strings in JSON) to {"logprob": ...}; entry 0 is None."""
    entries = answer.get("prompt_logprobs")
    if not entries or len(entries) != len(tokens):
        raise ValueError(f"expected {len(tokens)} prompt log-prob entries, got {len(entries or [])}")
    out = []
    for j in range(1, len(tokens)):
        entry = entries[j] or {}
        value = entry.get(str(tokens[j]), entry.get(tokens[j]))  # type: ignore[call-overload]
        if value is None:
            raise ValueError(f"prompt log-prob entry {j} lacks token {tokens[j]} (has {list(entry)[:5]})")
        out.append(float(value["logprob"] if isinstance(value, dict) else value))
    return out


def compare(
    trainer: Sequence[float],
    engines: Sequence[Sequence[float]],
    previous: Optional[Sequence[Sequence[float]]] = None,
    previous_trainer: Optional[Sequence[float]] = None,
) -> dict[str, Any]:
    """max_abs_diff per engine and overall; changed_max (the least-changed engine's) when `previous`
    is given; with `previous_trainer` too, trainer_changed_max and stale_engines: the indices of
    the engines whose log-probs did not move at all while the trainer's did (module docstring)."""
    diffs = [max(abs(e - t) for e, t in zip(eng, trainer)) for eng in engines]
    out: dict[str, Any] = {
        "max_abs_diff": max(diffs),
        "per_engine_max_abs_diff": diffs,
        "mean_abs_diff": sum(abs(e - t) for eng in engines for e, t in zip(eng, trainer))
        / (len(trainer) * len(engines)),
    }
    if previous is not None and len(previous) == len(engines):
        changed = [max(abs(a - b) for a, b in zip(now, before)) for now, before in zip(engines, previous)]
        out["changed_max"] = min(changed)
        if previous_trainer is not None and len(previous_trainer) == len(trainer):
            moved = max(abs(a - b) for a, b in zip(trainer, previous_trainer))
            out["trainer_changed_max"] = moved
            out["stale_engines"] = [i for i, c in enumerate(changed) if c == 0] if moved > 0 else []
    return out
