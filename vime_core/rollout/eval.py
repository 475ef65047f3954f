"""Eval rollout: every prompt of the eval dataset, n_samples_per_eval_prompt samples each, at
eval_temperature (0 = greedy), scored by the same reward. The training data source is not touched.

Metrics: eval/reward_mean (mean over the samples that were scored), eval/pass_at_n (share of the prompts
with a scored sample that have one of reward > 0), eval/response_len_mean, eval/truncated_rate,
eval/failed_count. A FAILED sample (not generated, or its reward function failed) counts in neither
figure, as in the rollout's reward statistics (data/group_rewards.py): its 0.0 is a placeholder,
and counting it would read as a worse model when the reward server or an engine failed. Failures
are counted in eval/failed_count and logged once per eval.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
from typing import Any

from vime_core.data.group_rewards import live_rewards
from vime_core.data.sample import Sample, Status
from vime_core.rollout.generate import GenerateContext, base_sampling_params
from vime_core.utils.timing import Stopwatch

logger = logging.getLogger(__name__)


def eval_samples(rows: list[Any], n_samples: int) -> list[list[Sample]]:
    """Groups of fresh samples for the eval rows (PromptRow-like: prompt_id, prompt, label, tokens)."""
    groups = []
    for g, row in enumerate(rows):
        groups.append(
            [
                Sample(
                    prompt_id=row.prompt_id,
                    prompt=row.prompt,
                    label=row.label,
                    tokens=list(row.tokens),
                    prompt_length=len(row.tokens),
                    group_index=g,
                    index=i,
                    session_id=f"eval-{g}-{i}",
                    metadata={**dict(row.metadata), "is_eval": True},
                )
                for i in range(n_samples)
            ]
        )
    return groups


async def run_eval(state: Any, rows: list[Any], rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
    cfg = state.cfg
    watch = Stopwatch()
    ctx = GenerateContext(
        cfg, state.generator, state.tokenizer, state.eos_token_id, admission_open=state.admission_open
    )
    # eval samples are scored, never trained: their log-probs would cost the engines for nothing
    params = base_sampling_params(cfg, temperature=cfg.eval_temperature, log_probs=False)
    sem = asyncio.Semaphore(state.concurrency)
    groups = eval_samples(rows, cfg.n_samples_per_eval_prompt)

    async def one(sample: Sample) -> Sample:
        async with sem:
            await state.generate_fn(ctx, sample, dict(params))  # the run's hook: a multi-turn recipe evaluates in turns
        if sample.status in (Status.COMPLETED, Status.TRUNCATED):
            await state.reward_hub.score(sample)
        if sample.reward is None:
            sample.reward = 0.0
        return sample

    samples = list(await asyncio.gather(*(one(s) for g in groups for s in g)))
    rewards = live_rewards(samples)
    scored_groups = [scored for g in groups if (scored := live_rewards(g))]
    solved = sum(any(r > 0 for r in g) for g in scored_groups)
    failed = sum(s.status is Status.FAILED for s in samples)
    if failed:
        logger.warning(
            "eval at rollout %d: %d of %d samples FAILED (not generated, or not scored); eval/reward_mean and "
            "eval/pass_at_n are over the %d scored",
            rollout_id,
            failed,
            len(samples),
            len(rewards),
        )
    metrics = {
        "eval/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
        "eval/pass_at_n": solved / max(1, len(scored_groups)),
        "eval/response_len_mean": statistics.fmean(s.response_length for s in samples) if samples else 0.0,
        "eval/truncated_rate": sum(s.status is Status.TRUNCATED for s in samples) / max(1, len(samples)),
        "eval/failed_count": float(failed),
        "eval/num_samples": float(len(samples)),
        "eval/time_s": watch.seconds,
        "eval/rollout_id": float(rollout_id),
    }
    return samples, metrics
