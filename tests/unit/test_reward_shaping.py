"""DAPO's overlong reward shaping (vime_core/algo/shaping.py) and its flags."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest

from vime_core.algo.advantages import postprocess_rewards
from vime_core.algo.shaping import check_overlong_buffer, overlong_penalty, shape_rewards
from vime_core.config import load_config
from vime_core.config.loader import ConfigError

L_MAX, L_CACHE = 20, 4


def _verl_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """verl's DAPO reward manager: min(-(|y| - (L_max - L_cache)) / L_cache * f, 0), which it only
    meets with |y| <= L_max; beyond L_max the paper's -f (times the factor)."""
    if length > max_len:
        return -factor
    exceed = length - (max_len - buffer_len)
    return min(-exceed / buffer_len * factor, 0.0)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty_matches_the_reference(factor):
    for length in range(0, L_MAX + 6):
        assert overlong_penalty(length, L_MAX, L_CACHE, factor) == pytest.approx(
            _verl_penalty(length, L_MAX, L_CACHE, factor), abs=1e-12
        ), length


def test_overlong_penalty_by_hand():
    # L_max - L_cache = 16: nothing up to 16 tokens, then -1/4 per token, -1 at and beyond 20
    assert [overlong_penalty(n, L_MAX, L_CACHE) for n in (1, 16, 17, 18, 19, 20, 21, 100)] == pytest.approx(
        [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    )
    assert overlong_penalty(20, L_MAX, L_MAX) == -1.0 and overlong_penalty(1, L_MAX, L_MAX) == pytest.approx(-1 / 20)
    with pytest.raises(ValueError, match=r"overlong_buffer_len=21 must be in \[1, 20\]"):
        overlong_penalty(5, L_MAX, 21)


def _cfg(**fields):
    base = dict(
        overlong_buffer_enable=True,
        overlong_buffer_len=L_CACHE,
        overlong_buffer_penalty_factor=1.0,
        rollout_max_response_len=L_MAX,
    )
    return SimpleNamespace(**{**base, **fields})


def test_shaped_rewards_enter_the_group_normalisation():
    rewards, lengths = [1.0, 1.0, 0.0, 1.0], [10, 18, 20, 17]
    shaped = shape_rewards(rewards, lengths, _cfg())
    assert shaped == pytest.approx([1.0, 0.5, -1.0, 0.75])
    assert shape_rewards(rewards, lengths, _cfg(overlong_buffer_enable=False)) == rewards
    # GRPO on the shaped rewards: (r' - mean) / (std + 1e-6), by hand
    mean = (1.0 + 0.5 - 1.0 + 0.75) / 4
    std = statistics.stdev([1.0, 0.5, -1.0, 0.75])
    assert postprocess_rewards(shaped, [0] * 4, "grpo") == pytest.approx([(r - mean) / (std + 1e-6) for r in shaped])
    with pytest.raises(ValueError, match="4 rewards but 3 response lengths"):
        shape_rewards(rewards, lengths[:3], _cfg())


def test_checks_of_the_flags_name_the_flag():
    check_overlong_buffer(_cfg())
    check_overlong_buffer(_cfg(overlong_buffer_enable=False, overlong_buffer_len=None))
    for fields, message in [
        ({"overlong_buffer_len": None}, "overlong_buffer_enable=true needs overlong_buffer_len"),
        ({"overlong_buffer_len": 21}, "overlong_buffer_len=21 is longer than rollout_max_response_len=20"),
        ({"overlong_buffer_enable": False}, "overlong_buffer_len=4 has no effect without overlong_buffer_enable=true"),
    ]:
        with pytest.raises(ValueError, match=message):
            check_overlong_buffer(_cfg(**fields))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"overlong_buffer_enable": True}, r"overlong_buffer_enable=true needs overlong_buffer_len"),
        ({"overlong_buffer_len": 8}, r"overlong_buffer_len=8 has no effect without overlong_buffer_enable=true"),
        (
            {"overlong_buffer_enable": True, "overlong_buffer_len": 5000},
            r"overlong_buffer_len=5000 is longer than rollout_max_response_len=1024",
        ),
        ({"overlong_buffer_len": 0}, r"overlong_buffer_len"),
        ({"overlong_buffer_penalty_factor": -1}, r"overlong_buffer_penalty_factor"),
    ],
)
def test_bad_combinations_fail_when_the_configuration_is_made(fields, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"hf_checkpoint": "some/model", **fields})


def test_the_batch_builder_shapes_the_rewards_before_the_group_normalisation():
    """build_batch: reward = GRPO of r + R_length; raw_reward keeps the score; a failed sample is
    in neither the shaping nor its group's statistics."""
    from vime_core.data.batch import build_batch
    from vime_core.data.sample import Sample, Status

    cfg = load_config(
        overrides={
            "hf_checkpoint": "some/model",
            "rollout_max_response_len": L_MAX,
            "overlong_buffer_enable": True,
            "overlong_buffer_len": L_CACHE,
        }
    )
    rewards, lengths = [1.0, 1.0, 0.0, 1.0, 1.0], [10, 18, 20, 17, 19]
    samples = []
    for i, (reward, n) in enumerate(zip(rewards, lengths)):
        s = Sample(
            prompt_id="p0",
            tokens=[1, 2],
            prompt_length=2,
            group_index=0,
            index=i,
            session_id=f"s{i}",
            status=Status.FAILED if i == 4 else Status.COMPLETED,
            finish_reason="stop",
            reward=reward,
        )
        s.append_response_tokens([7] * n, None)
        samples.append(s)
    batch = build_batch(samples, cfg)
    shaped = [1.0, 0.5, -1.0, 0.75]  # by hand: 0, -2/4, -4/4, -1/4 added
    mean, std = statistics.fmean(shaped), statistics.stdev(shaped)
    assert batch["reward"] == pytest.approx([(r - mean) / (std + 1e-6) for r in shaped] + [0.0])
    assert batch["advantage"] == batch["reward"]
    assert batch["raw_reward"] == [1.0, 1.0, 0.0, 1.0, 0.0]
    # without the flag the same samples give plain GRPO: the three equal scores tie
    plain = build_batch(
        samples, load_config(overrides={"hf_checkpoint": "some/model", "rollout_max_response_len": L_MAX})
    )
    assert plain["reward"][0] == plain["reward"][1] == plain["reward"][3] > 0 > plain["reward"][2]


def test_flags_are_in_help_docs_and_the_form():
    from vime_core.config.docs import config_table
    from vime_core.config.loader import build_parser
    from vime_core.config import VimeConfig

    help_text, table = build_parser().format_help(), config_table()
    properties = VimeConfig.model_json_schema()["properties"]
    for name in ("overlong_buffer_enable", "overlong_buffer_len", "overlong_buffer_penalty_factor"):
        flag = "--" + name.replace("_", "-")
        assert flag in help_text and f"`{flag}`" in table and name in properties
    assert load_config().overlong_buffer_enable is False
