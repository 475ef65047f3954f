"""Rollout importance weights at token, sequence and geometric level, truncated (TIS) or masked
(MIS) (vime_core/algo/losses.py, rollout_is_weights), against a token-by-token reference; the
train step's loss under use_tis / tis_level / tis_mode on a tiny batch; the flags' checks."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.algo.losses import rollout_is_weights, tis_weights

# three samples, flat; sample 1's last token is masked out (a tool output)
OLD = [[-0.5, -1.0, -0.2], [-2.0, -0.1, -3.0], [-0.7]]
ROLLOUT = [[-0.6, -0.7, -0.2], [-1.2, -0.3, -0.1], [-0.75]]
MASK = [[1, 1, 1], [1, 1, 0], [1]]
LENGTHS = [len(s) for s in OLD]


def _flat(rows):
    return torch.tensor([x for row in rows for x in row], dtype=torch.float32)


def _reference(level: str, mode: str, upper: float, lower: float | None = None) -> list[float]:
    """Per sample: the token ratios pi_old / pi_rollout one by one; sequence: their product over
    the valid tokens, geometric: its n-th root; then truncated, or zeroed outside [lower, upper]."""
    lower = 1 / upper if lower is None else lower
    out = []
    for old, rollout, mask in zip(OLD, ROLLOUT, MASK):
        ratios = [math.exp(o) / math.exp(r) for o, r in zip(old, rollout)]
        product, valid = 1.0, 0
        for ratio, m in zip(ratios, mask):
            if m:
                product *= ratio
                valid += 1
        for ratio in ratios:
            rho = {"token": ratio, "sequence": product, "geometric": product ** (1 / valid)}[level]
            if mode == "truncate":
                out.append(min(rho, upper))
            else:
                out.append(rho if lower <= rho <= upper else 0.0)
    return out


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode, upper", [("truncate", 2.0), ("truncate", 1.2), ("mask", 2.0), ("mask", 1.5)])
def test_weights_match_the_reference(level, mode, upper):
    w = rollout_is_weights(_flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level=level, mode=mode, upper=upper)
    assert w.tolist() == pytest.approx(_reference(level, mode, upper), rel=1e-5, abs=1e-7)


def test_sequence_level_by_hand():
    # sample 0: exp(0.1 - 0.3 + 0) = exp(-0.2); sample 1 (last token masked): exp(-0.8 + 0.2) = exp(-0.6);
    # sample 2: exp(0.05)
    w = rollout_is_weights(
        _flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="truncate", upper=2.0
    )
    expected = [math.exp(-0.2)] * 3 + [math.exp(-0.6)] * 3 + [math.exp(0.05)]
    assert w.tolist() == pytest.approx(expected, rel=1e-6)
    # MIS with C = 1.5: sample 1's exp(-0.6) = 0.55 < 1/1.5 is rejected as a whole
    masked = rollout_is_weights(
        _flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="mask", upper=1.5
    )
    assert masked.tolist() == pytest.approx([math.exp(-0.2)] * 3 + [0.0] * 3 + [math.exp(0.05)], rel=1e-6)
    lenient = rollout_is_weights(
        _flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="mask", upper=1.5, lower=0.5
    )
    assert lenient.tolist() == pytest.approx(expected, rel=1e-6)


def test_token_truncate_is_the_tis_weight_and_weights_carry_no_gradient():
    old = _flat(OLD).requires_grad_()
    w = rollout_is_weights(old, _flat(ROLLOUT), _flat(MASK), LENGTHS, level="token", mode="truncate", upper=2.0)
    assert not w.requires_grad
    assert w.tolist() == pytest.approx(tis_weights(old, _flat(ROLLOUT), 2.0).tolist(), rel=1e-6)


def test_a_huge_sequence_ratio_is_bounded_and_bad_arguments_are_named():
    old, rollout = torch.zeros(30), torch.full((30,), -2.0)  # log ratio 60 over the sequence
    w = rollout_is_weights(old, rollout, torch.ones(30), [30], level="sequence", mode="truncate", upper=1e30)
    assert torch.isfinite(w).all() and w[0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
    with pytest.raises(ValueError, match="unknown importance-sampling level 'seq'"):
        rollout_is_weights(old, rollout, torch.ones(30), [30], level="seq")
    with pytest.raises(ValueError, match="unknown importance-sampling mode 'clip'"):
        rollout_is_weights(old, rollout, torch.ones(30), [30], mode="clip")
    with pytest.raises(ValueError, match=r"old_log_probs has shape \(30,\); expected flat \[31\]"):
        rollout_is_weights(old, rollout, torch.ones(30), [31])


# ---- in the train step (vime_core/trainer/train_step.py, micro_batch_loss) ---------------------

ADVANTAGES = [1.0, -1.0, 0.5]
CURRENT = [
    [o + d for o, d in zip(old, deltas)] for old, deltas in zip(OLD, [[0.05, -0.1, 0.0], [0.1, 0.02, 0.3], [-0.04]])
]


def _is_config(**fields):
    from vime_core.config import load_config

    return load_config(
        overrides={
            "hf_checkpoint": "some/model",
            "use_tis": True,
            "tis_clip": 1.5,
            "entropy_coef": 0.0,
            "rollout_batch_size": 1,
            "n_samples_per_prompt": 3,
            "micro_batch_size": 3,
            **fields,
        }
    )


def _step_loss(monkeypatch, cfg):
    """micro_batch_loss on the tiny batch (one micro-batch, the whole step) with the model's
    log-probs replaced by CURRENT -> (loss, d loss / d CURRENT, accumulated metrics)."""
    from vime_core.trainer import train_step

    current = _flat(CURRENT).requires_grad_()
    monkeypatch.setattr(train_step, "packed_response_log_probs", lambda *a, **k: (current, torch.zeros_like(current)))
    batch = {
        "tokens": [[1, 2] + [7] * n for n in LENGTHS],
        "response_length": LENGTHS,
        "loss_mask": MASK,
        "rollout_log_probs": ROLLOUT,
    }
    indices = list(range(len(LENGTHS)))
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=[indices],
        denominators=train_step.StepDenominators.of(batch, indices),
        advantages={i: torch.full((n,), ADVANTAGES[i]) for i, n in enumerate(LENGTHS)},
        old_log_probs={i: torch.tensor(OLD[i]) for i in indices},
    )
    acc = train_step._Accumulator()
    loss = train_step.micro_batch_loss(None, train_step.make_micro_batch(batch, indices, "cpu"), inputs, cfg, 32, acc)
    loss.backward()
    return loss.item(), current.grad.tolist(), acc


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_the_step_loss_is_the_ppo_loss_times_the_weights_over_every_loss_token(monkeypatch, level, mode):
    """token_mean of w_t * PPO-clip_t with the pre-step loss-mask count as denominator, so a
    rejected token adds 0 and still counts (slime's choice); a rejected sample gets no gradient."""
    weights = _reference(level, mode, 1.5)
    ratios = [math.exp(c - o) for c, o in zip(_flat(CURRENT).tolist(), _flat(OLD).tolist())]
    advantages = [a for a, n in zip(ADVANTAGES, LENGTHS) for _ in range(n)]
    mask = _flat(MASK).tolist()
    pg = [max(-r * a, -min(max(r, 0.8), 1.2) * a) for r, a in zip(ratios, advantages)]
    expected = sum(m * w * x for m, w, x in zip(mask, weights, pg)) / sum(mask)

    loss, grad, acc = _step_loss(monkeypatch, _is_config(tis_level=level, tis_mode=mode))
    assert loss == pytest.approx(expected, rel=1e-5)
    assert acc.counts["tis_weight"] == 6 and acc.sums["tis_weight"].item() == pytest.approx(
        sum(m * w for m, w in zip(mask, weights)), rel=1e-6
    )
    rejected = [m * (w == 0.0) for m, w in zip(mask, weights)]
    if mode == "mask":
        assert acc.sums["tis_rejected_frac"].item() == sum(rejected)
    else:
        assert acc.counts["tis_rejected_frac"] == 0  # not reported
    # no ratio leaves [0.8, 1.2] on a loss token: a gradient exactly where a kept token is
    assert [g != 0.0 for g in grad] == [bool(m) and w != 0.0 for m, w in zip(mask, weights)]
    if (level, mode) == ("sequence", "mask"):
        # by hand (test_sequence_level_by_hand): sample 1, exp(-0.6) < 1 / 1.5, is rejected whole
        assert weights[3:6] == [0.0] * 3 and sum(rejected) == 2 and grad[3:6] == [0.0] * 3


def test_without_use_tis_the_loss_is_unweighted_and_the_default_is_the_tis_weight(monkeypatch):
    plain, _, acc = _step_loss(monkeypatch, _is_config(use_tis=False, tis_clip=2.0))  # tis_clip: use_tis's
    assert acc.counts["tis_weight"] == 0
    truncated, _, _ = _step_loss(monkeypatch, _is_config())  # token / truncate: TIS as before
    ratios = [math.exp(c - o) for c, o in zip(_flat(CURRENT).tolist(), _flat(OLD).tolist())]
    advantages = [a for a, n in zip(ADVANTAGES, LENGTHS) for _ in range(n)]
    w = tis_weights(_flat(OLD), _flat(ROLLOUT), 1.5).tolist()
    pg = [max(-r * a, -min(max(r, 0.8), 1.2) * a) for r, a in zip(ratios, advantages)]
    mask = _flat(MASK).tolist()
    assert plain == pytest.approx(sum(m * x for m, x in zip(mask, pg)) / sum(mask), rel=1e-5)
    assert truncated == pytest.approx(sum(m * wi * x for m, wi, x in zip(mask, w, pg)) / sum(mask), rel=1e-5)


# ---- the flags -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tis_level": "sequence"}, r"tis_level=sequence has no effect without use_tis=true"),
        ({"tis_mode": "mask"}, r"tis_mode=mask has no effect without use_tis=true"),
        ({"tis_clip_low": 0.5}, r"tis_clip_low=0.5 has no effect without use_tis=true"),
        ({"tis_clip": 3.0}, r"tis_clip=3.0 has no effect without use_tis=true"),
        ({"use_tis": True, "tis_clip_low": 0.5}, r"tis_clip_low=0.5 has no effect without tis_mode=mask"),
        ({"use_tis": True, "tis_mode": "mask", "tis_clip_low": 2.0}, r"tis_clip_low=2.0 must be below tis_clip=2.0"),
        (
            {"use_tis": True, "use_rollout_logprobs": True},
            r"use_tis=true with use_rollout_logprobs=true: .* every weight exp\(old - rollout\) is 1",
        ),
        ({"use_tis": True, "tis_level": "seq"}, r"tis_level"),
        ({"use_tis": True, "tis_mode": "clip"}, r"tis_mode"),
    ],
)
def test_bad_combinations_fail_when_the_configuration_is_made(fields, message):
    from vime_core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"hf_checkpoint": "some/model", **fields})


def test_the_flags_ask_the_engines_for_log_probs_and_are_in_help_docs_and_the_form():
    from vime_core.config import VimeConfig, load_config, needs_rollout_logprobs, rollout_logprob_readers
    from vime_core.config.docs import config_table
    from vime_core.config.loader import build_parser

    cfg = load_config(overrides={"use_tis": True, "tis_level": "sequence", "tis_mode": "mask", "tis_clip_low": 0.5})
    assert (cfg.tis_level, cfg.tis_mode, cfg.tis_clip_low) == ("sequence", "mask", 0.5)
    assert needs_rollout_logprobs(cfg) and rollout_logprob_readers(cfg) == ["use_tis"]
    assert not needs_rollout_logprobs(load_config())
    help_text, table = build_parser().format_help(), config_table()
    properties = VimeConfig.model_json_schema()["properties"]
    for name in ("tis_level", "tis_mode", "tis_clip_low"):
        flag = "--" + name.replace("_", "-")
        assert flag in help_text and f"`{flag}`" in table and name in properties
    assert properties["tis_mode"]["enum"] == ["truncate", "mask"]
