"""Rollout importance weights at token, sequence and geometric level, truncated (TIS) or masked
(MIS) (vime_core/algo/losses.py, rollout_is_weights), against a token-by-token reference."""

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
    w = rollout_is_weights(_flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="truncate", upper=2.0)
    expected = [math.exp(-0.2)] * 3 + [math.exp(-0.6)] * 3 + [math.exp(0.05)]
    assert w.tolist() == pytest.approx(expected, rel=1e-6)
    # MIS with C = 1.5: sample 1's exp(-0.6) = 0.55 < 1/1.5 is rejected as a whole
    masked = rollout_is_weights(_flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="mask", upper=1.5)
    assert masked.tolist() == pytest.approx([math.exp(-0.2)] * 3 + [0.0] * 3 + [math.exp(0.05)], rel=1e-6)
    lenient = rollout_is_weights(_flat(OLD), _flat(ROLLOUT), _flat(MASK), LENGTHS, level="sequence", mode="mask",
                                 upper=1.5, lower=0.5)
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
