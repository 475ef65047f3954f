"""Reward shaping before the estimator's group normalisation: DAPO's soft overlong punishment (Yu et
al. 2025, arXiv:2503.14476, eq. 13), with L_max = rollout_max_response_len, L_cache =
overlong_buffer_len and f = overlong_buffer_penalty_factor (verl's overlong_buffer_cfg, flattened):

    R_length(y) = 0                                        |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache * f   L_max - L_cache < |y| <= L_max
                = -f                                       L_max < |y|

    r'_i = r_i + R_length(y_i)             when overlong_buffer_enable, else r'_i = r_i"""

from __future__ import annotations

from typing import Sequence


def overlong_penalty(
    response_length: int, max_response_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> float:
    """R_length(y) of the module docstring for |y| = response_length."""
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(
            f"overlong_buffer_len={buffer_len} must be in [1, {max_response_len}] (rollout_max_response_len)"
        )
    expected = max_response_len - buffer_len  # L_max - L_cache
    if response_length <= expected:
        return 0.0
    if response_length <= max_response_len:
        return (expected - response_length) / buffer_len * penalty_factor
    return -penalty_factor


def shape_rewards(rewards: Sequence[float], response_lengths: Sequence[int], cfg) -> list[float]:
    """r'_i = r_i + R_length(y_i) when cfg.overlong_buffer_enable, else the rewards unchanged."""
    if len(rewards) != len(response_lengths):
        raise ValueError(f"{len(rewards)} rewards but {len(response_lengths)} response lengths")
    if not cfg.overlong_buffer_enable:
        return [float(r) for r in rewards]
    return [
        float(r)
        + overlong_penalty(
            int(n), cfg.rollout_max_response_len, cfg.overlong_buffer_len, cfg.overlong_buffer_penalty_factor
        )
        for r, n in zip(rewards, response_lengths)
    ]


def check_overlong_buffer(cfg) -> None:
    """The configuration's checks of the overlong_buffer_* flags (one line naming the flag)."""
    if not cfg.overlong_buffer_enable:
        if cfg.overlong_buffer_len is not None:
            raise ValueError(
                f"overlong_buffer_len={cfg.overlong_buffer_len} has no effect without overlong_buffer_enable=true"
            )
        return
    if cfg.overlong_buffer_len is None:
        raise ValueError(
            "overlong_buffer_enable=true needs overlong_buffer_len (L_cache, the tokens over which the penalty grows)"
        )
    if cfg.overlong_buffer_len > cfg.rollout_max_response_len:
        raise ValueError(
            f"overlong_buffer_len={cfg.overlong_buffer_len} is longer than "
            f"rollout_max_response_len={cfg.rollout_max_response_len} (L_max)"
        )
