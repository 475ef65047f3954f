"""On-policy distillation moves the tiny student toward a teacher, on the CPU (use_opd,
opd_type=megatron; vime_core/algo/advantages.py, apply_opd_kl).

The teacher is the student's own checkpoint with its final norm's weight times 4: the same
network at a lower temperature, peaked where the student is nearly uniform (its reverse KL from
the student is ~1.3 nats per token at the start). The reward is 0 for every sample, so GRPO's
group-normalised advantage is 0 and the teacher's signal is the only one; entropy_coef is 0.
Everything between the engine and the optimizer is the run's own code, as in test_learning.py
(whose stand-in engine, PolicySampler, samples here too): the rollout loop, the batch builder,
and the Megatron trainer, which loads the teacher from opd_teacher_load (vocabulary checked) and
forwards it beside the policy.

Judged independently of the trainer's numbers: after each rollout, transformers' forwards of the
sampler's model (the student's weights that sampled) and of the teacher give each sample's mean
log pi_student - log pi_teacher over its response tokens. The mean of the last K iterations must
be below that of the first K by Z standard errors of the difference (each sample one
observation). The trainer's own opd_reverse_kl (its forwards of policy and teacher) must equal
the token mean of the same numbers, every iteration.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import statistics
import time

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ITERATIONS = 16
K = 4  # iterations per window
Z = 3.0  # standard errors the drop must clear
PROMPTS, SAMPLES = 16, 4  # per rollout
SHARPEN = 4.0  # the teacher's final norm weight, times the student's


def zero_reward(sample) -> float:
    """The run's reward (custom_rm_path): 0, so the teacher is the only signal."""
    return 0.0


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("teacher") / "tiny-qwen3-sharp"
    shutil.copytree(tiny_model_dir, out)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(SHARPEN)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


@torch.no_grad()
def _per_sample_reverse_kl(student, teacher, batch) -> list[tuple[float, float]]:
    """Per sample, (sum, count) over its loss tokens of log pi_student - log pi_teacher (transformers)."""
    out = []
    for tokens, n, mask in zip(batch["tokens"], batch["response_length"], batch["loss_mask"]):
        x = torch.tensor([tokens])
        target = x[0, -n:]
        lp = [
            m(input_ids=x).logits[0, -n - 1 : -1].float().log_softmax(-1).gather(1, target[:, None])[:, 0]
            for m in (student, teacher)
        ]
        m = torch.tensor(mask, dtype=torch.float32)
        out.append((float(((lp[0] - lp[1]) * m).sum()), float(m.sum())))
    return out


def test_the_student_moves_toward_the_teacher(single_rank, tiny_model_dir, teacher_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.integration.trainer.test_learning import PolicySampler
    from vime_core.data.batch import build_batch
    from vime_core.data.data_source import DataSource
    from vime_core.demo.settings import demo_config
    from vime_core.demo.task import write_dataset
    from vime_core.rewards.filters import load_filter
    from vime_core.rewards.hub import RewardHub
    from vime_core.rollout.loop import RolloutState, generate_rollout
    from vime_core.trainer.trainer import MegatronTrainer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    cfg = demo_config(
        hf_checkpoint=str(tiny_model_dir),
        storage_uri=str(tmp_path),
        prompt_data=str(write_dataset(tmp_path / "arith.jsonl")),
        custom_rm_path=f"{__name__}:zero_reward",
        entropy_coef=0.0,
        use_opd=True,
        opd_type="megatron",
        opd_teacher_load=str(teacher_dir),
        opd_kl_coef=1.0,
        rollout_batch_size=PROMPTS,
        n_samples_per_prompt=SAMPLES,
        micro_batch_size=64,
        num_rollout=ITERATIONS,
    )
    start = time.perf_counter()
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)  # the session's process group is reused
    trainer.init()
    assert trainer.teacher_model is not None and trainer.ref_model is None
    load = lambda path: AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()  # noqa: E731
    sampler, teacher = PolicySampler(load(tiny_model_dir), tokenizer.eos_token_id), load(teacher_dir)
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
    per_iteration, reported = [], []
    for k in range(ITERATIONS):
        sampler.load(trainer, version=k + 1)
        samples, _ = asyncio.run(generate_rollout(state, k))
        batch = build_batch(samples, cfg)
        assert set(batch["raw_reward"]) == {0.0}
        per_iteration.append(_per_sample_reverse_kl(sampler.model, teacher, batch))  # before the update
        metrics = trainer.train(k, batch)
        assert math.isfinite(metrics["loss"])
        reported.append(metrics["opd_reverse_kl"])

    # the trainer's teacher and student log-probs are transformers': the same token means
    token_means = [sum(s for s, _ in values) / sum(n for _, n in values) for values in per_iteration]
    assert reported == pytest.approx(token_means, abs=1e-3)
    curve = [round(m, 3) for m in token_means]
    first = [s / n for values in per_iteration[:K] for s, n in values if n]
    last = [s / n for values in per_iteration[-K:] for s, n in values if n]
    se = math.hypot(statistics.stdev(first) / math.sqrt(len(first)), statistics.stdev(last) / math.sqrt(len(last)))
    drop, margin = statistics.fmean(first) - statistics.fmean(last), Z * se
    print(
        f"opd: reverse KL {statistics.fmean(first):.3f} -> {statistics.fmean(last):.3f} (margin {margin:.3f}) "
        f"in {time.perf_counter() - start:.0f} s; per iteration {curve}; trainer's {[round(r, 3) for r in reported]}"
    )
    assert drop > margin, f"the student did not move toward the teacher: drop {drop:.3f}, margin {margin:.3f}; {curve}"
