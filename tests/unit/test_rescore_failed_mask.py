"""A sample whose reward failed is stored with a zero loss mask (no gradient) and the mask it had in
its metadata; `vime rescore`, scoring it again with a reward that works, gives it back that mask, so
the replayed batch trains it as generated (tool tokens at 0). Before, the rescored sample moved its
group's advantages but was never trained itself (found by the rollout audit)."""

from __future__ import annotations

import json

import pytest

from vime_core.config import make_config
from vime_core.data.batch import MASK_BEFORE_FAILURE_KEY, build_batch, mask_of_runs, mask_runs
from vime_core.data.data_source import PromptRow
from vime_core.data.sample import Sample, Status
from vime_core.rescore import samples_of

MASK = [1, 1, 0, 0, 1]  # a model turn, a tool turn, a model turn


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _sample(index: int, status: Status, **metadata) -> Sample:
    return Sample(
        prompt_id="p",
        tokens=[4, 13, 4, 5, 6, 7, 8, 2],
        prompt_length=3,
        response_length=len(MASK),
        loss_mask=list(MASK),
        reward=0.0,
        status=status,
        finish_reason="stop",
        group_index=0,
        index=index,
        metadata=dict(metadata),
    )


def test_runs_round_trip():
    assert mask_runs(MASK) == [[1, 2], [0, 2], [1, 1]] and mask_of_runs(mask_runs(MASK)) == MASK
    assert mask_runs([]) == [] and mask_of_runs([]) == []


def test_a_rescored_reward_failure_is_trained_with_the_mask_it_had(tokenizer):
    cfg = make_config({"n_samples_per_prompt": 2})
    failed = _sample(0, Status.FAILED, reward_error="TimeoutError: rm timed out", reward_error_type="TimeoutError")
    stored = build_batch([failed, _sample(1, Status.COMPLETED)], cfg)
    assert stored["loss_mask"] == [[0] * len(MASK), MASK]  # stored: no gradient
    assert json.loads(stored["metadata"][0])[MASK_BEFORE_FAILURE_KEY] == mask_runs(MASK)
    assert MASK_BEFORE_FAILURE_KEY not in json.loads(stored["metadata"][1])

    samples = samples_of(stored, {"p": PromptRow("p", "1+1", "2")}, tokenizer, cfg)
    assert samples[0].status is Status.COMPLETED and samples[0].loss_mask == MASK
    assert not {"reward_error", MASK_BEFORE_FAILURE_KEY} & set(samples[0].metadata)


def test_a_failure_stored_without_its_mask_stays_failed(tokenizer):
    """A batch stored before the mask was kept: which tokens it trained is unknown, so not re-scored."""
    cfg = make_config({"n_samples_per_prompt": 2})
    stored = build_batch([_sample(0, Status.FAILED, reward_error="E"), _sample(1, Status.COMPLETED)], cfg)
    metadata = json.loads(stored["metadata"][0])
    del metadata[MASK_BEFORE_FAILURE_KEY]
    stored["metadata"][0] = json.dumps(metadata)
    samples = samples_of(stored, {"p": PromptRow("p", "1+1", "2")}, tokenizer, cfg)
    assert samples[0].status is Status.FAILED and samples[0].loss_mask == [0] * len(MASK)
