"""Synthetic rollout batches of a chosen shape, for tests, benchmarks and examples: seeded, respecting
the invariants batch_to_table checks, float32-representable log-probs (exact round trip), rewards
normalised by the builder's own function."""

from __future__ import annotations

import json
import random

import numpy as np

from vime_core.algo.advantages import postprocess_rewards
from vime_core.data.columns import COLUMN_NAMES


def synthetic_batch(
    num_groups: int = 4,
    group_size: int = 4,
    prompt_len: int = 8,
    max_response_len: int = 16,
    min_response_len: int = 1,
    weight_version: int = 1,
    seed: int = 0,
    prompt_prefix: str = "p",
    vocab_size: int = 19,
) -> dict[str, list]:
    """A batch dict of num_groups x group_size samples; response lengths drawn uniformly from
    [min_response_len, max_response_len].

    A sample whose response straddles a weight update gets two spans (version and version+1),
    as vLLM reports it.
    """
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    batch: dict[str, list] = {name: [] for name in COLUMN_NAMES}
    for g in range(num_groups):
        raw = [float(rng.randint(0, 1)) for _ in range(group_size)]
        normalised = postprocess_rewards(raw, [g] * group_size, "grpo")
        for i in range(group_size):
            response = rng.randint(min_response_len, max_response_len)
            tokens = np_rng.integers(0, vocab_size, prompt_len + response).tolist()
            split = rng.randint(0, response) if rng.random() < 0.25 else response
            spans = [{"version": weight_version, "start": 0, "end": split}] if split else []
            if split < response:
                spans.append({"version": weight_version + 1, "start": split, "end": response})
            batch["prompt_id"].append(f"{prompt_prefix}{g}")
            batch["group_index"].append(g)
            batch["index"].append(i)
            batch["tokens"].append(tokens)
            batch["prompt_length"].append(prompt_len)
            batch["response_length"].append(response)
            batch["total_length"].append(prompt_len + response)
            batch["loss_mask"].append([1] * response)
            batch["rollout_log_probs"].append(np_rng.uniform(-5, 0, response).astype(np.float32).tolist())
            batch["raw_reward"].append(raw[i])
            batch["reward"].append(normalised[i])
            batch["advantage"].append(normalised[i])
            batch["status"].append("completed" if response < max_response_len else "truncated")
            batch["finish_reason"].append("stop" if response < max_response_len else "length")
            batch["weight_versions"].append(spans)
            batch["session_id"].append(f"{prompt_prefix}{g}-{i}")
            batch["is_eval"].append(False)
            batch["metadata"].append(json.dumps({"seed": seed}))
            batch["routed_experts"].append(None)
    return batch
