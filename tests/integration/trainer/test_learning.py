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

LoRA (test_lora_learns_from_a_format_tuned_base_as_full_weights_do): GRPO with adapters only and
with the full weights, both from one base that answers in the task's format (a short SFT).
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
# LoRA on every linear layer; adapters take a larger lr than full weights (as PEFT users do)
LORA = {"lora_rank": 16, "lora_alpha": 32.0, "lr": 5e-3}
FORMAT_STEPS = 30  # SFT steps of the format-tuned base (_format_tuned_base)
FORMAT_RIGHT = 0.25  # of its SFT answers, the right sum; the others a random digit


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


def _learn(cfg, model_dir, tokenizer, label: str) -> None:
    """Train ITERATIONS rollouts of the default task from `model_dir` with `cfg` and assert the
    reward rose by the run's own margin (the module docstring)."""
    from transformers import AutoModelForCausalLM

    from vime_core.data.batch import build_batch
    from vime_core.data.data_source import DataSource
    from vime_core.rewards.filters import load_filter
    from vime_core.rewards.hub import RewardHub
    from vime_core.rollout.loop import RolloutState, generate_rollout
    from vime_core.trainer.trainer import MegatronTrainer

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
        if trainer.critic is not None:
            assert math.isfinite(metrics["value_loss"]) and 0 <= metrics["value_clipfrac"] <= 1
            explained.append(round(metrics.get("explained_variance", math.nan), 3))
        curve.append(round(statistics.fmean(batch["raw_reward"]), 3))

    (first, first_se), (last, last_se) = _window(groups[:K]), _window(groups[-K:])
    margin = Z * math.hypot(first_se, last_se)
    seconds = time.perf_counter() - start
    print(f"{label}: reward {first:.3f} -> {last:.3f} (margin {margin:.3f}) in {seconds:.0f} s; {curve}")
    if explained:
        print(f"{label}: explained variance of the returns {explained}")
        # the returns vary from the first iteration with a reward; the critic must have learnt to
        # explain part of their variance by the last K
        early, late = [e for e in explained[:K] if math.isfinite(e)], explained[-K:]
        assert statistics.fmean(late) > max(0.0, statistics.fmean(early)), explained
    assert last - first > margin, (
        f"{label} did not learn: first {K} {first:.3f}, last {K} {last:.3f}, margin {margin:.3f}; {curve}"
    )


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_the_estimator_learns_the_default_task(single_rank, task, tmp_path, estimator):
    from vime_core.demo.settings import demo_config

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
    _learn(cfg, model_dir, tokenizer, estimator)


def _format_tuned_base(model_dir, data, tokenizer, folder) -> str:
    """The tiny model after SFT (full weights) on "a+b=" -> a digit then EOS, the right sum for
    FORMAT_RIGHT of them and a random digit otherwise: it answers in the task's format and is
    right more often than chance, as a pretrained base partly knows a task. Written as an HF
    folder."""
    import json
    import random

    from vime_core.data.data_source import tokenize_prompt
    from vime_core.demo.settings import demo_config
    from vime_core.demo.task import MAX_OPERAND
    from vime_core.trainer.trainer import MegatronTrainer

    rows = [json.loads(line) for line in open(data)]
    prompts = [tokenize_prompt(tokenizer, r["prompt"], False) for r in rows]
    rng = random.Random(0)
    cfg = demo_config(
        hf_checkpoint=str(model_dir),
        storage_uri=str(folder),
        prompt_data=str(data),
        loss_type="sft_loss",
        rollout_batch_size=len(rows),
        n_samples_per_prompt=SAMPLES,
        micro_batch_size=64,
        num_rollout=FORMAT_STEPS,
        entropy_coef=0.0,
    )
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    for k in range(FORMAT_STEPS):
        tokens, responses = [], []
        for row, prompt in zip(rows, prompts):
            for _ in range(SAMPLES):
                digit = row["label"] if rng.random() < FORMAT_RIGHT else str(rng.randint(0, 2 * MAX_OPERAND))
                answer = tokenizer.encode(digit, add_special_tokens=False)
                tokens.append(prompt + answer + [tokenizer.eos_token_id])
                responses.append(len(answer) + 1)
        batch = {
            "tokens": tokens,
            "response_length": responses,
            "total_length": [len(t) for t in tokens],
            "loss_mask": [[1] * r for r in responses],
            "reward": [0.0] * len(tokens),
        }
        trainer.train(k, batch)
    return trainer.export_hf(str(folder / "format-tuned"))


@pytest.fixture(scope="module")
def format_tuned(single_rank, task, tmp_path_factory):
    model_dir, data, tokenizer = task
    return _format_tuned_base(model_dir, data, tokenizer, tmp_path_factory.mktemp("format-tuned"))


@pytest.mark.parametrize("weights", ["lora", "full"])
def test_lora_learns_from_a_format_tuned_base_as_full_weights_do(single_rank, task, format_tuned, tmp_path, weights):
    """GRPO training LoRA adapters only (every linear layer; the embeddings, norms and head
    frozen; the sampler loading the merged weights the trainer publishes), and the full weights
    beside it from the same base. From the freshly initialised model LoRA barely moves the reward
    in 20 iterations (frozen random embeddings and head: measured 0.008 -> 0.018), so both start,
    as LoRA is used, from a base that already answers in the task's format."""
    from vime_core.demo.settings import demo_config

    _, data, tokenizer = task
    cfg = demo_config(
        hf_checkpoint=format_tuned,
        storage_uri=str(tmp_path),
        prompt_data=str(data),
        rollout_batch_size=PROMPTS,
        n_samples_per_prompt=SAMPLES,
        micro_batch_size=64,
        num_rollout=ITERATIONS,
        **(LORA if weights == "lora" else {}),
    )
    _learn(cfg, format_tuned, tokenizer, f"grpo_{weights}")
