"""Sample.append_response_tokens (a generated response joining its sample) and round trips."""

from __future__ import annotations

import pytest

from vime_core.data.sample import Sample, Status, WeightSpan


def test_append_response_tokens_reference_numbers():
    prompt = list(range(200))
    s = Sample(tokens=list(prompt), prompt_length=200)
    ids, logps = [101, 202, 151645], [-0.42, -1.10, -0.08]
    s.append_response_tokens(ids, logps)
    assert len(s.tokens) == len(prompt) + len(ids) == 203
    assert s.response_length == 3 and s.loss_mask == [1, 1, 1]
    assert s.rollout_log_probs == logps and s.response_tokens == ids
    assert s.total_length == 203


def test_mismatched_lengths_raise_and_leave_sample_unchanged():
    s = Sample(tokens=[1, 2], prompt_length=2)
    with pytest.raises(ValueError, match="3 tokens but 2 log-probs"):
        s.append_response_tokens([5, 6, 7], [-0.1, -0.2])
    assert s.tokens == [1, 2] and s.response_length == 0 and s.loss_mask == []


def test_appending_twice_and_masked_tokens():
    s = Sample(tokens=[1], prompt_length=1)
    s.append_response_tokens([5], [-0.1])
    s.append_response_tokens([6, 7], [-0.2, -0.3], loss_mask_value=0)  # e.g. tool output
    assert s.loss_mask == [1, 0, 0] and s.response_tokens == [5, 6, 7]


def test_dict_round_trip_and_copy_is_deep():
    s = Sample(
        prompt_id="p",
        tokens=[1, 2, 3],
        response_length=1,
        status=Status.TRUNCATED,
        weight_versions=[WeightSpan(1, 0, 1)],
        metadata={"a": [1]},
    )
    d = s.to_dict()
    assert d["status"] == "truncated" and d["weight_versions"] == [{"version": 1, "start": 0, "end": 1}]
    assert Sample.from_dict(d) == s
    c = s.copy()
    c.metadata["a"].append(2)
    assert s.metadata == {"a": [1]}


def test_a_response_carries_one_log_prob_per_token_or_none():
    s = Sample(tokens=[1], prompt_length=1)
    s.append_response_tokens([5, 6], None)  # not asked for
    assert s.response_length == 2 and s.rollout_log_probs == [] and s.loss_mask == [1, 1]
    s.append_response_tokens([7], [0.0], loss_mask_value=0)  # e.g. a tool's tokens: no full column to join
    assert s.response_length == 3 and s.rollout_log_probs == []
    s = Sample(tokens=[1], prompt_length=1)
    s.append_response_tokens([5], [-0.1])
    s.append_response_tokens([6], None)  # a part without them: the column cannot be partial
    assert s.response_length == 2 and s.rollout_log_probs == []
