"""Each advantage estimator learns the default task on the CPU: GRPO, GSPO, CISPO, REINFORCE++,
RLOO and PPO (with its critic), each from the freshly initialised tiny model (the embedded demo's,
with its settings).

Everything between the engine and the optimizer is the run's own code: the rollout loop (data
source, per-sample generate, reward hub, group filter: vime_core.rollout.loop.generate_rollout),
the batch builder, and the Megatron trainer in this process (train_on_rollout: old and reference
log-probs, the estimator's advantages and policy loss, Adam). The engine is replaced by
`PolicySampler`, which answers like vLLM's /inference/v1/generate from the trainer's current
weights, loaded in the HF layout the trainer publishes (iter_hf_weights) before each rollout.
Ray, Prefect and vLLM are left out: they are the same for every estimator and the train flow
tests run them (tests/integration/flows); leaving them out makes one estimator's run short enough
to test each estimator.
The runs are deterministic: the trainer seeds torch with cfg.seed, and the sampler draws from it.

Learning is judged from the run itself: the mean reward of the last K iterations must exceed
that of the first K by Z standard errors of that difference, the standard error taken from the
spread of the groups' mean rewards (samples of one prompt are not independent; each group is
one observation), so the margin is what the run's own noise makes significant.

Per estimator, beside --advantage-estimator (the demo's settings otherwise):
    gspo, cispo  two optimizer steps per rollout, so the second step is off-policy and GSPO's
                 sequence-level clip or CISPO's truncated weight acts: with one step the ratio is
                 1 and both give GRPO's gradient
    reinforce_plus_plus  the KL penalty in the token rewards (--kl-coef) against the reference,
                 with the engine's log-probs as the old policy (--use-rollout-logprobs), the path
                 of 45fda68's fix
    ppo          the critic as configured by default: the policy's body, a zero value head,
                 critic_lr = lr; GAE with gamma = lambd = 1. Its value metrics are reported and the
                 critic must explain part of the returns' variance by the last iterations
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERATIONS = 20
K = 5  # iterations per window
Z = 3.0  # standard errors the gain must clear
PROMPTS, SAMPLES = 32, 8  # per rollout

ESTIMATORS = {
    "grpo": {},
    "gspo": {"num_steps_per_rollout": 2},
    "cispo": {"num_steps_per_rollout": 2},
    "reinforce_plus_plus": {"kl_coef": 1e-3, "use_rollout_logprobs": True},
    "rloo": {},
    "ppo": {},
}


class PolicySampler:
    """An engine for the rollout loop: samples from an HF model holding the trainer's weights and
    answers in vLLM 0.32's shape (token ids, the processed log-prob of each when asked for, finish
    reason, weight-version span). Requests that arrive together are sampled as one batch."""

    name = "policy-sampler"

    def __init__(self, model, eos_token_id: int):
        self.model, self.eos, self.version = model, eos_token_id, 0
        self._pending: list = []

    def load(self, trainer, version: int) -> None:
        missing, unexpected = self.model.load_state_dict(dict(trainer.iter_hf_weights()), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied head
        self.version = version

    async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
        loop = asyncio.get_running_loop()
        answer = loop.create_future()
        self._pending.append((list(token_ids), sampling_params, answer))
        if len(self._pending) == 1:
            loop.call_soon(self._sample_pending)
        return await answer

    async def abort_requests(self):
        return 0

    @torch.no_grad()
    def _sample_pending(self) -> None:
        pending, self._pending = self._pending, []
        batches: dict[tuple, list] = {}
        for request in pending:
            params = request[1]
            batches.setdefault((len(request[0]), params["max_tokens"], params["temperature"]), []).append(request)
        for (_, max_tokens, temperature), requests in batches.items():
            x = torch.tensor([tokens for tokens, _, _ in requests])
            sampled, log_probs = [], []
            for _ in range(max_tokens):
                logp = (self.model(input_ids=x).logits[:, -1].float() / temperature).log_softmax(-1)
                token = torch.multinomial(logp.exp(), 1)
                sampled.append(token[:, 0])
                log_probs.append(logp.gather(1, token)[:, 0])
                x = torch.cat([x, token], 1)
            for (_, params, answer), tokens, lps in zip(
                requests, torch.stack(sampled, 1).tolist(), torch.stack(log_probs, 1).tolist()
            ):
                n = tokens.index(self.eos) + 1 if self.eos in tokens else len(tokens)
                content = [
                    {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": []} for t, lp in zip(tokens[:n], lps[:n])
                ]
                answer.set_result(
                    {
                        "choices": [
                            {
                                "token_ids": tokens[:n],
                                "finish_reason": "stop" if self.eos in tokens else "length",
                                "logprobs": {"content": content} if params.get("logprobs") is not None else None,
                                "weight_versions": [{"version": str(self.version), "start": 0, "end": n}],
                            }
                        ],
                        "usage": {"completion_tokens": n},
                    }
                )


def _group_means(batch) -> list[float]:
    groups: dict[int, list[float]] = {}
    for g, r in zip(batch["group_index"], batch["raw_reward"]):
        groups.setdefault(g, []).append(r)
    return [statistics.fmean(rs) for rs in groups.values()]


def _window(per_iteration: list[list[float]]) -> tuple[float, float]:
    """(mean reward, its standard error) over the groups of the window's iterations."""
    groups = [m for means in per_iteration for m in means]
    return statistics.fmean(groups), statistics.stdev(groups) / math.sqrt(len(groups))


@pytest.fixture(scope="module")
def task(tiny_model_dir, tmp_path_factory):
    from transformers import AutoTokenizer

    from vime_core.demo.task import write_dataset

    data = write_dataset(tmp_path_factory.mktemp("arith") / "arith.jsonl")
    return tiny_model_dir, data, AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_the_estimator_learns_the_default_task(single_rank, task, tmp_path, estimator):
    from transformers import AutoModelForCausalLM

    from vime_core.data.batch import build_batch
    from vime_core.data.data_source import DataSource
    from vime_core.demo.settings import demo_config
    from vime_core.rewards.filters import load_filter
    from vime_core.rewards.hub import RewardHub
    from vime_core.rollout.loop import RolloutState, generate_rollout
    from vime_core.trainer.trainer import MegatronTrainer

    model_dir, data, tokenizer = task
    cfg = demo_config(
        hf_checkpoint=str(model_dir),
        storage_uri=str(tmp_path),
        prompt_data=str(data),
        advantage_estimator=estimator,
        rollout_batch_size=PROMPTS,
        n_samples_per_prompt=SAMPLES,
        micro_batch_size=64,
        num_rollout=ITERATIONS,
        **ESTIMATORS[estimator],
    )
    start = time.perf_counter()
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)  # the session's process group is reused
    trainer.init()  # seeds torch with cfg.seed: the sampling below is reproducible
    sampler = PolicySampler(
        AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval(), tokenizer.eos_token_id
    )
    state = RolloutState(
        cfg=cfg,
        data_source=DataSource(cfg, tokenizer=tokenizer),
        reward_hub=RewardHub(cfg),
        generator=sampler,
        engines=[sampler],
        tokenizer=tokenizer,
        group_filter=load_filter(cfg.dynamic_sampling_filter_path),
        eos_token_id=tokenizer.eos_token_id,
        concurrency=PROMPTS * SAMPLES,
    )
    groups, curve, explained = [], [], []
    for k in range(ITERATIONS):
        sampler.load(trainer, version=k + 1)
        samples, _ = asyncio.run(generate_rollout(state, k))
        batch = build_batch(samples, cfg)
        metrics = trainer.train(k, batch)
        assert math.isfinite(metrics["loss"]) and metrics["num_steps"] == cfg.num_steps_per_rollout
        groups.append(_group_means(batch))
        if estimator == "ppo":
            assert math.isfinite(metrics["value_loss"]) and 0 <= metrics["value_clipfrac"] <= 1
            explained.append(round(metrics.get("explained_variance", math.nan), 3))
        curve.append(round(statistics.fmean(batch["raw_reward"]), 3))

    (first, first_se), (last, last_se) = _window(groups[:K]), _window(groups[-K:])
    margin = Z * math.hypot(first_se, last_se)
    print(
        (
            f"{estimator}: reward {first:.3f} -> {last:.3f} (margin {margin:.3f}) in "
            f"{time.perf_counter() - start:.0f} s; {curve}"
        )
    )
    if explained:
        print(f"{estimator}: explained variance of the returns {explained}")
        # the returns vary from the first iteration with a reward; the critic must have learnt to
        # explain part of their variance by the last K
        early, late = [e for e in explained[:K] if math.isfinite(e)], explained[-K:]
        assert statistics.fmean(late) > max(0.0, statistics.fmean(early)), explained
    assert last - first > margin, (
        f"{estimator} did not learn: first {K} {first:.3f}, last {K} {last:.3f}, margin {margin:.3f}; {curve}"
    )
