"""Benchmark of the step's pure math, each against a baseline measured in the same run: build_batch and
the DP schedule against copying the same lists, the registered PPO-clip loss against the same loss
inline, and GRPO / REINFORCE++ advantages against a torch broadcast. Prints JSON (medians, ratio =
vime / baseline). Run: bench/run.py math [--repeats N]"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from vime_core.algo.advantages import compute_advantages
from vime_core.algo.losses import PolicyLossParams, aggregate_loss
from vime_core.algo.registry import get_policy_loss_fn
from vime_core.config import load_config
from vime_core.data.batch import build_batch
from vime_core.data.sample import Sample, Status
from vime_core.data.schedule import build_dp_schedule

GROUPS, GROUP_SIZE, PROMPT_LEN, MAX_RESPONSE = 32, 8, 64, 1024
N = GROUPS * GROUP_SIZE


def median_seconds(*fns, repeats: int) -> list[float]:
    """Median wall time of each fn; the fns run interleaved in every repeat so drift of the shared
    machine's load hits all of them alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def make_samples(rng: random.Random) -> list[Sample]:
    samples = []
    for g in range(GROUPS):
        for i in range(GROUP_SIZE):
            n = rng.randint(1, MAX_RESPONSE)
            s = Sample(
                prompt_id=f"p{g}",
                tokens=[rng.randrange(32000) for _ in range(PROMPT_LEN)],
                prompt_length=PROMPT_LEN,
                group_index=g,
                index=i,
                session_id=f"b-{g}-{i}",
                status=Status.COMPLETED,
                finish_reason="stop",
                reward=float(rng.random() < 0.5),
            )
            s.append_response_tokens([rng.randrange(32000) for _ in range(n)], [-rng.random() for _ in range(n)])
            samples.append(s)
    return samples


def bench_build(repeats: int, cfg) -> dict:
    samples = make_samples(random.Random(0))

    def vime_fixed():
        batch = build_batch(samples, cfg)
        build_dp_schedule(batch["total_length"], 256, 4, 8)

    def vime_packed():
        batch = build_batch(samples, cfg)
        build_dp_schedule(batch["total_length"], 256, 4, 8, max_tokens_per_gpu=8192)

    def baseline():
        {
            "tokens": [list(s.tokens) for s in samples],
            "loss_mask": [list(s.loss_mask) for s in samples],
            "rollout_log_probs": [list(s.rollout_log_probs) for s in samples],
        }

    base, fixed, packed = median_seconds(baseline, vime_fixed, vime_packed, repeats=repeats)
    return {
        "samples": N,
        "tokens": sum(s.total_length for s in samples),
        "baseline_s": base,
        "vime_fixed_s": fixed,
        "ratio_fixed": fixed / base,
        "vime_packed_s": packed,
        "ratio_packed": packed / base,
    }


def bench_loss(repeats: int) -> dict:
    g = torch.Generator().manual_seed(0)
    T = N * MAX_RESPONSE
    base_logp = -torch.rand(T, generator=g)
    old = base_logp + 0.05 * torch.randn(T, generator=g)
    advantages = torch.randn(N, generator=g).repeat_interleave(MAX_RESPONSE)
    mask = (torch.rand(T, generator=g) > 0.1).float()
    lengths = [MAX_RESPONSE] * N
    params = PolicyLossParams(0.2, 0.28)
    loss_fn = get_policy_loss_fn("ppo")

    def vime():
        logp = base_logp.clone().requires_grad_(True)
        per_token, clipfrac = loss_fn(logp, old, advantages, mask, lengths, params)
        aggregate_loss(per_token, mask, "token_mean").backward()
        aggregate_loss(clipfrac, mask, "token_mean")

    def baseline():
        logp = base_logp.clone().requires_grad_(True)
        ratio = torch.exp(logp - old)
        unclipped, clipped = ratio * advantages, ratio.clamp(0.8, 1.28) * advantages
        per_token = -torch.minimum(unclipped, clipped)
        ((per_token * mask).sum() / mask.sum()).backward()
        ((clipped < unclipped).float() * mask).sum() / mask.sum()  # clip fraction, as vime reports

    base, t = median_seconds(baseline, vime, repeats=repeats)
    return {"tokens": T, "baseline_s": base, "vime_s": t, "ratio": t / base}


def bench_advantages(repeats: int) -> dict:
    rewards = [float(i % 2) for i in range(N)]
    masks = [torch.ones(MAX_RESPONSE) for _ in range(N)]

    def baseline():
        torch.tensor(rewards).unsqueeze(1).expand(N, MAX_RESPONSE).contiguous()

    base, grpo, rpp = median_seconds(
        baseline,
        lambda: compute_advantages("grpo", rewards, masks),
        lambda: compute_advantages("reinforce_plus_plus", rewards, masks, gamma=0.99),
        repeats=repeats,
    )
    return {
        "tokens": N * MAX_RESPONSE,
        "baseline_s": base,
        "grpo_s": grpo,
        "ratio_grpo": grpo / base,
        "reinforce_plus_plus_s": rpp,
        "ratio_reinforce_plus_plus": rpp / base,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    cfg = load_config(overrides={"rollout_batch_size": GROUPS, "n_samples_per_prompt": GROUP_SIZE})
    result = {
        "bench": "bench_math",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "repeats": args.repeats,
        "build_and_schedule_256": bench_build(args.repeats, cfg),
        "policy_loss_fwd_bwd_256x1024": bench_loss(args.repeats),
        "advantages_256x1024": bench_advantages(args.repeats),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
