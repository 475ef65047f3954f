"""On-policy distillation (use_opd, slime's --use-opd family): the advantage's reverse-KL term
(vime_core/algo/advantages.py, apply_opd_kl) against numbers computed by hand from
probabilities; train_on_rollout's teacher forward and the student log-probs it pairs with it;
the step's opd_reverse_kl metric; the flags' checks; the teacher's vocabulary check."""

from __future__ import annotations

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch

from vime_core.config import ConfigError, load_config
from vime_core.data.batch import build_batch
from vime_core.data.sample import Sample, Status, WeightSpan

# Per token: the probability the student's old policy and the teacher gave the sampled token.
STUDENT_P = [[0.5, 0.25, 0.9], [0.1], [0.6, 0.3]]
TEACHER_P = [[0.8, 0.05, 0.9], [0.4], [0.2, 0.3]]
RAW = [1.0, 0.0, 1.0]  # one group of three


def _by_hand(base: list[float], coef: float) -> list[float]:
    """A_t + coef * ln(p_teacher / p_student) per token, from the probabilities."""
    out = []
    for a, ps, pt in zip(base, STUDENT_P, TEACHER_P):
        out.extend(a + coef * math.log(t / s) for s, t in zip(ps, pt))
    return out


def _logs(rows):
    return [torch.tensor([math.log(p) for p in row]) for row in rows]


def test_the_advantage_is_the_base_one_minus_coef_times_the_reverse_kl():
    from vime_core.algo.advantages import apply_opd_kl

    base = [0.5, -1.0, 0.5]
    advantages = [torch.full((len(row),), a) for a, row in zip(base, STUDENT_P)]
    shaped, rkl = apply_opd_kl(advantages, _logs(STUDENT_P), _logs(TEACHER_P), 0.5)
    assert torch.cat(shaped).tolist() == pytest.approx(_by_hand(base, 0.5), abs=1e-6)
    # a token the teacher finds likelier (0.8 > 0.5) is pushed up; an equal one (0.9) is left alone
    assert shaped[0][0] > 0.5 and shaped[0][2].item() == pytest.approx(0.5) and shaped[0][1] < 0.5
    assert torch.cat(rkl).tolist() == pytest.approx(
        [math.log(s / t) for ps, pt in zip(STUDENT_P, TEACHER_P) for s, t in zip(ps, pt)], abs=1e-6
    )
    with pytest.raises(ValueError, match="sample 1: 1 advantages, 1 student and 2 teacher log-probs"):
        apply_opd_kl(advantages, _logs(STUDENT_P), _logs([[0.8, 0.05, 0.9], [0.4, 0.1], [0.2, 0.3]]), 1.0)


# ---- in train_on_rollout (vime_core/trainer/rollout_training.py) ----------------------------------

ENGINE_P = [[0.4, 0.2, 0.8], [0.2], [0.5, 0.35]]  # the engine's log-probs: another student estimate


def _batch(cfg) -> dict:
    samples = []
    for i, (reward, probs) in enumerate(zip(RAW, ENGINE_P)):
        s = Sample(
            prompt_id="p0",
            tokens=[1, 2],
            prompt_length=2,
            group_index=0,
            index=i,
            session_id=f"s-{i}",
            status=Status.COMPLETED,
            finish_reason="stop",
            reward=reward,
        )
        s.append_response_tokens(list(range(10, 10 + len(probs))), [math.log(p) for p in probs])
        s.weight_versions = [WeightSpan(1, 0, len(probs))]
        samples.append(s)
    return build_batch(samples, cfg)


def _config(**fields):
    return load_config(
        overrides={
            "rollout_batch_size": 1,
            "n_samples_per_prompt": len(RAW),
            "micro_batch_size": len(RAW),
            "use_opd": True,
            "opd_type": "megatron",
            "opd_teacher_load": "/teacher",
            **fields,
        }
    )


def _train(monkeypatch, cfg):
    """train_on_rollout with the forwards answering STUDENT_P (policy) / TEACHER_P (teacher) ->
    (forwards run, the StepInputs of the one step)."""
    from vime_core.trainer import rollout_training
    from vime_core.trainer.rollout_training import train_on_rollout

    forwards, steps = [], []

    def forward_log_probs(model, batch, micro_batches, vocab, temperature, device, replay=False):
        forwards.append(model)
        rows = _logs(TEACHER_P if model == "teacher" else STUDENT_P)
        return {i: rows[i] for mb in micro_batches for i in mb}

    def step(model, optimizer, inputs, *args, **kwargs):
        steps.append(inputs)
        return {"lr": 0.0, "loss": 0.0}

    monkeypatch.setattr(rollout_training, "forward_log_probs", forward_log_probs)
    monkeypatch.setattr(rollout_training, "train_step", step)
    trainer = SimpleNamespace(
        cfg=cfg,
        layout=SimpleNamespace(dp_size=1, dp_rank=0),
        arch=SimpleNamespace(vocab_size=32),
        device="cpu",
        model="policy",
        ref_model=None,
        teacher_model="teacher",
        optimizer=None,
        scheduler=None,
    )
    train_on_rollout(trainer, _batch(cfg))
    return forwards, steps[0]


def _grpo(raw: list[float]) -> list[float]:
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((r - mean) ** 2 for r in raw) / (len(raw) - 1))
    return [(r - mean) / (std + 1e-6) for r in raw]


def test_the_trainer_forwards_the_teacher_and_shapes_the_grpo_advantages(monkeypatch):
    """GRPO's group-normalised reward broadcast over the tokens, minus 0.5 * (log pi_old -
    log pi_teacher), pi_old recomputed (a step cannot reuse its own log-probs under use_opd)."""
    forwards, inputs = _train(monkeypatch, _config(opd_kl_coef=0.5))
    assert sorted(forwards) == ["policy", "teacher"]
    assert torch.cat([inputs.advantages[i] for i in range(3)]).tolist() == pytest.approx(
        _by_hand(_grpo(RAW), 0.5), abs=1e-5
    )
    assert inputs.teacher_log_probs is not None and inputs.old_log_probs is not None


def test_with_rollout_log_probs_the_student_is_the_engine(monkeypatch):
    """As slime: under use_rollout_logprobs the student's log-probs are the engine's."""
    forwards, inputs = _train(monkeypatch, _config(use_rollout_logprobs=True))
    assert forwards == ["teacher"]
    expected = [a + math.log(t / s) for a, ps, pt in zip(_grpo(RAW), ENGINE_P, TEACHER_P) for s, t in zip(ps, pt)]
    assert torch.cat([inputs.advantages[i] for i in range(3)]).tolist() == pytest.approx(expected, abs=1e-5)


def test_the_step_reports_the_mean_reverse_kl_over_the_loss_tokens(monkeypatch):
    from vime_core.trainer import train_step

    cfg = _config()
    batch = _batch(cfg)
    batch["loss_mask"] = [[1, 1, 0], [1], [1, 1]]  # a masked token does not count
    indices = [0, 1, 2]
    current = torch.cat(_logs(STUDENT_P)).requires_grad_()
    monkeypatch.setattr(train_step, "packed_response_log_probs", lambda *a, **k: (current, torch.zeros_like(current)))
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=[indices],
        denominators=train_step.StepDenominators.of(batch, indices),
        advantages={i: torch.zeros(len(p)) for i, p in enumerate(STUDENT_P)},
        old_log_probs=dict(enumerate(_logs(STUDENT_P))),
        teacher_log_probs=dict(enumerate(_logs(TEACHER_P))),
    )
    acc = train_step._Accumulator()
    train_step.micro_batch_loss(None, train_step.make_micro_batch(batch, indices, "cpu"), inputs, cfg, 32, acc)
    kept = [
        math.log(s / t)
        for ps, pt, ms in zip(STUDENT_P, TEACHER_P, batch["loss_mask"])
        for s, t, m in zip(ps, pt, ms)
        if m
    ]
    assert acc.counts["opd_reverse_kl"] == 5
    assert acc.sums["opd_reverse_kl"].item() / 5 == pytest.approx(sum(kept) / 5, abs=1e-6)


# ---- the flags ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"use_opd": True}, r"use_opd=true needs --opd-type"),
        ({"use_opd": True, "opd_type": "megatron"}, r"needs --opd-teacher-load"),
        ({"opd_teacher_load": "/teacher"}, r"opd_teacher_load='/teacher' is set but use_opd is not: add --use-opd"),
        ({"opd_type": "megatron"}, r"opd_type=megatron has no effect without use_opd=true"),
        ({"opd_kl_coef": 0.5}, r"opd_kl_coef=0.5 has no effect without use_opd=true"),
        ({"use_opd": True, "opd_type": "sglang", "opd_teacher_load": "/teacher"}, r"opd_type"),
    ],
)
def test_bad_combinations_fail_when_the_configuration_is_made(fields, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"hf_checkpoint": "some/model", **fields})


def test_the_gates_load_a_teacher_and_never_reuse_log_probs_under_opd():
    from vime_core.algo.gates import can_reuse_log_probs_in_loss, needs_reference, needs_teacher

    cfg = _config()
    assert needs_teacher(cfg) and not needs_reference(cfg) and not can_reuse_log_probs_in_loss([3], cfg)
    assert not needs_teacher(load_config()) and can_reuse_log_probs_in_loss([3], load_config())


def test_the_flags_are_in_help_docs_and_the_form():
    from vime_core.config import VimeConfig
    from vime_core.config.docs import config_table
    from vime_core.config.loader import build_parser

    help_text, table = build_parser().format_help(), config_table()
    properties = VimeConfig.model_json_schema()["properties"]
    for name in ("use_opd", "opd_type", "opd_kl_coef", "opd_teacher_load"):
        flag = "--" + name.replace("_", "-")
        assert flag in help_text and f"`{flag}`" in table and name in properties


# ---- the teacher's vocabulary (vime_core/trainer/teacher.py) ----------------------------------


def test_the_teacher_needs_the_students_vocabulary(tiny_model_dir, tmp_path):
    from vime_core.trainer.teacher import check_teacher_checkpoint

    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    assert check_teacher_checkpoint(tiny_model_dir, same)["vocab_size"] == 19

    bigger = tmp_path / "bigger"
    shutil.copytree(tiny_model_dir, bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": 32}))
    with pytest.raises(ValueError, match=rf"{bigger / 'config.json'} has vocab_size=32, the student .* 19"):
        check_teacher_checkpoint(tiny_model_dir, bigger)

    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_model_dir, swapped)
    tokenizer = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]
    (swapped / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=rf"the tokenizer of {swapped / 'tokenizer.json'} .* is not the student's"):
        check_teacher_checkpoint(tiny_model_dir, swapped)

    with pytest.raises(FileNotFoundError, match="no HF checkpoint there"):
        check_teacher_checkpoint(tiny_model_dir, tmp_path / "missing")


def test_the_teacher_is_a_folder_or_hub_id_resolved_like_hf_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    """resolve_run_config (the driver, before the actors start): a relative folder becomes
    absolute, a hub id its cached snapshot; an uncached one is an error naming the flag."""
    from tests.unit.test_hub_checkpoint import cache_snapshot
    from vime_core.config import make_config
    from vime_core.models.hub import HubCheckpointError
    from vime_core.run_assets import resolve_run_config

    cache = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_snapshot(cache, "vime-test/teacher", tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "teachers" / "local")

    def resolved(teacher):
        cfg = make_config(
            {
                "hf_checkpoint": str(tiny_model_dir),
                "storage_uri": str(tmp_path / "storage"),
                "prompt_data": str(tmp_path / "p.jsonl"),
                "use_opd": True,
                "opd_type": "megatron",
                "opd_teacher_load": teacher,
            }
        )
        return resolve_run_config(cfg, base=tmp_path).opd_teacher_load

    assert resolved("vime-test/teacher") == str(snapshot)
    assert resolved("teachers/local") == str(tmp_path / "teachers" / "local")
    with pytest.raises(
        HubCheckpointError, match=r"^opd_teacher_load: hub model 'vime-test/absent' has no cached snapshot"
    ):
        resolved("vime-test/absent")
