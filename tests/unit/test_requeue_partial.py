"""partial_rollout gives an unfinished group back for the next rollout: what its samples generated
is off-policy there (loss mask 0) and an aborted sample continues; a FAILED sample (its reward or
its generation failed) goes back as its prompt alone. Continued, it would have had tokens appended
after its EOS and trained (found by an audit: a reward timeout in a group still running)."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.data.sample import Sample, Status
from vime_core.rollout.generate import GenerateContext, generate_sample
from vime_core.rollout.loop import requeue_partial

PROMPT = [5, 13, 6, 15]
EOS = 2


def _sample(index: int, status: Status, response: list[int], **metadata) -> Sample:
    s = Sample(tokens=list(PROMPT), prompt_length=len(PROMPT), group_index=7, index=index, metadata=dict(metadata))
    s.append_response_tokens(response, [-0.5] * len(response))
    s.status = status
    return s


class _Source:
    def __init__(self):
        self.given_back: list[list[Sample]] = []

    def add_back(self, groups):
        self.given_back.extend(groups)


def test_a_failed_sample_goes_back_as_its_prompt_and_the_others_keep_theirs_masked():
    failed = _sample(0, Status.FAILED, [5, EOS], reward_error="TimeoutError: rm timed out")
    failed.reward = 0.0
    done = _sample(1, Status.COMPLETED, [5, EOS])
    aborted = _sample(2, Status.ABORTED, [7])
    source = _Source()
    assert requeue_partial(source, [[failed, done, aborted]]) == 3
    assert source.given_back == [[failed, done, aborted]]
    assert failed.tokens == PROMPT and failed.response_length == 0 and failed.loss_mask == []
    assert failed.status is Status.PENDING and failed.reward is None and "reward_error" not in failed.metadata
    assert done.status is Status.COMPLETED and done.response_tokens == [5, EOS] and done.loss_mask == [0, 0]
    assert aborted.status is Status.PENDING and aborted.response_tokens == [7] and aborted.loss_mask == [0]
    assert [s.metadata["requeued"] for s in (failed, done, aborted)] == [1, 1, 1]


def test_generation_refuses_to_continue_a_failed_sample():
    failed = _sample(0, Status.FAILED, [5, EOS])
    ctx = GenerateContext.__new__(GenerateContext)  # the check comes before anything the context holds
    ctx.cfg = None
    with pytest.raises(ValueError, match="sample 7/0 is FAILED: only a pending or aborted sample is generated"):
        asyncio.run(generate_sample(ctx, failed, {}))
