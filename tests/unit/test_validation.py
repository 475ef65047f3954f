"""The one trainability check (vime_core/data/validation.py) that the rollout side, the trainer
and resume apply."""

import pytest

from vime_core.data.validation import UntrainableBatchError, validate_trainable


def _batch(**changes):
    batch = {
        "prompt_id": ["p0", "p1"],
        "tokens": [[1, 2, 3], [1, 4, 5, 6]],
        "prompt_length": [2, 2],
        "response_length": [1, 2],
        "loss_mask": [[1], [1, 1]],
        "rollout_log_probs": [[-0.1], []],
        "metadata": ["{}", "{}"],
    }
    batch.update(changes)
    return batch


def test_a_consistent_batch_passes():
    assert validate_trainable(_batch()) == 2


@pytest.mark.parametrize("changes, message", [
    ({"response_length": [1, 0], "tokens": [[1, 2, 3], [1, 4]], "loss_mask": [[1], []],
      "metadata": ["{}", '{"generate_error": "no engine answered"}']},
     r"sample 1 \(prompt 'p1'\): response_length=0, no response to train on; .*no engine answered"),
    ({"prompt_length": [0, 2], "tokens": [[2, 3], [1, 4, 5, 6]], "response_length": [2, 2], "loss_mask": [[1, 1], [1, 1]],
      "rollout_log_probs": [[], []]}, r"sample 0 .*prompt_length=0 must be >= 1"),
    ({"tokens": [[1, 2, 3], [1, 4, 5]]}, r"sample 1 .*3 tokens != prompt_length 2 \+ response_length 2"),
    ({"loss_mask": [[1], [1]]}, r"sample 1 .*loss_mask has 1 entries, response_length=2"),
    ({"rollout_log_probs": [[-0.1, -0.2], []]}, r"sample 0 .*rollout_log_probs has 2 entries"),
    ({"loss_mask": [[1]]}, r"column 'loss_mask' has 1 rows, 'tokens' has 2"),
])
def test_each_rule_names_the_sample_and_what_is_wrong(changes, message):
    with pytest.raises(UntrainableBatchError, match=message):
        validate_trainable(_batch(**changes))


def test_missing_columns_and_an_empty_batch():
    batch = _batch()
    del batch["loss_mask"]
    with pytest.raises(UntrainableBatchError, match=r"lacks column\(s\) \['loss_mask'\]"):
        validate_trainable(batch)
    with pytest.raises(UntrainableBatchError, match="no samples"):
        validate_trainable({"tokens": [], "response_length": [], "loss_mask": []})


def test_without_prompt_length_a_response_still_needs_a_prompt_token():
    batch = {"tokens": [[5, 6]], "response_length": [2], "loss_mask": [[1, 1]]}
    with pytest.raises(UntrainableBatchError, match="leaves no prompt token"):
        validate_trainable(batch)


def test_total_length_must_count_the_tokens_and_rows_name_their_group():
    batch = _batch(total_length=[3, 5], group_index=[7, 7], index=[0, 1])
    with pytest.raises(UntrainableBatchError, match=r"sample 1 \(group 7 index 1, prompt 'p1'\): total_length=5 != 4 tokens"):
        validate_trainable(batch)


def test_lengths_only_keeps_the_length_rules_and_drops_trainability():
    """What the builder and the store check: lengths that agree, whether or not a sample has a
    response (an empty batch too)."""
    no_response = _batch(response_length=[1, 0], tokens=[[1, 2, 3], [1, 4]], loss_mask=[[1], []])
    with pytest.raises(UntrainableBatchError, match="no response"):
        validate_trainable(no_response)
    assert validate_trainable(no_response, lengths_only=True) == 2
    assert validate_trainable({"tokens": [], "response_length": [], "loss_mask": []}, lengths_only=True) == 0
    with pytest.raises(UntrainableBatchError, match="loss_mask has 1 entries"):
        validate_trainable(_batch(loss_mask=[[1], [1]]), lengths_only=True)
