"""The one trainability check (vime_core/data/validation.py) that the rollout side, the trainer
and resume apply."""

import json

import pytest

from vime_core.data.validation import UntrainableBatchError, validate_trainable


def _span(role: str, start: int, end: int) -> dict:
    return {"role": role, "turn": 0, "start": start, "end": end}


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


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {
                "response_length": [1, 0],
                "tokens": [[1, 2, 3], [1, 4]],
                "loss_mask": [[1], []],
                "metadata": ["{}", '{"generate_error": "no engine answered"}'],
            },
            r"sample 1 \(prompt 'p1'\): response_length=0, no response to train on; .*no engine answered",
        ),
        (
            {
                "prompt_length": [0, 2],
                "tokens": [[2, 3], [1, 4, 5, 6]],
                "response_length": [2, 2],
                "loss_mask": [[1, 1], [1, 1]],
                "rollout_log_probs": [[], []],
            },
            r"sample 0 .*prompt_length=0 must be >= 1",
        ),
        ({"tokens": [[1, 2, 3], [1, 4, 5]]}, r"sample 1 .*3 tokens != prompt_length 2 \+ response_length 2"),
        ({"loss_mask": [[1], [1]]}, r"sample 1 .*loss_mask has 1 entries, response_length=2"),
        ({"rollout_log_probs": [[-0.1, -0.2], []]}, r"sample 0 .*rollout_log_probs has 2 entries"),
        ({"loss_mask": [[1]]}, r"column 'loss_mask' has 1 rows, 'tokens' has 2"),
        (  # a generate hook that appended the tool's output with the default loss mask 1
            {"metadata": ["{}", json.dumps({"turns": [_span("model", 0, 1), _span("tool", 1, 2)]})]},
            r"sample 1 .*turn span 1 \(tool, turn 0\) has tokens with loss mask 1",
        ),
        (
            {"metadata": ["{}", json.dumps({"turns": [_span("model", 0, 1)]})]},
            r"sample 1 .*turn spans end at 1; the response has 2 tokens",
        ),
    ],
)
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
    with pytest.raises(
        UntrainableBatchError, match=r"sample 1 \(group 7 index 1, prompt 'p1'\): total_length=5 != 4 tokens"
    ):
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


# ---- the engines' log-probs, where a flag reads them -------------------------------------------


def test_log_probs_are_only_required_where_a_flag_reads_them():
    """Empty rollout_log_probs (not asked for) is trainable without a reader; -9999 entries too
    (the trainer does not read them then); both are refused, naming the column, with one."""
    no_log_probs = _batch(rollout_log_probs=[[], []])
    assert validate_trainable(no_log_probs) == 2
    with pytest.raises(UntrainableBatchError) as err:
        validate_trainable(no_log_probs, log_prob_readers=["use_tis"])
    assert str(err.value) == (
        "sample 0 (prompt 'p0'): rollout_log_probs is empty (generated without asking the engines "
        "for log-probs), and use_tis needs them"
    )
    assert validate_trainable(_batch(rollout_log_probs=[[-0.1], [-0.2, -0.3]]), log_prob_readers=["use_tis"]) == 2


def test_missing_log_probs_name_the_engine_from_the_sample_metadata():
    batch = _batch(
        rollout_log_probs=[[-0.1], [-0.2, -9999.0]],
        metadata=["{}", '{"missing_logprobs": 1, "missing_logprobs_engine": "engine-1 at http://127.0.0.1:8001"}'],
    )
    assert validate_trainable(batch) == 2
    with pytest.raises(UntrainableBatchError) as err:
        validate_trainable(batch, log_prob_readers=["use_rollout_logprobs", "get_mismatch_metrics"])
    message = str(err.value)
    assert "\n" not in message
    assert message == (
        "sample 1 (prompt 'p1'): rollout_log_probs lacks 1 of 2 log-probs: engine engine-1 at "
        "http://127.0.0.1:8001 answered without them (field logprobs.content[j].logprob of its choice), "
        "and use_rollout_logprobs and get_mismatch_metrics need them"
    )
    # NaN is no log-prob either
    with pytest.raises(UntrainableBatchError, match=r"sample 0 .*lacks 1 of 1 log-probs: the engine answered"):
        validate_trainable(_batch(rollout_log_probs=[[float("nan")], [-0.2, -0.3]]), log_prob_readers=["use_tis"])


def test_a_batch_without_the_column_is_refused_naming_it_where_a_flag_reads_it():
    batch = _batch()
    del batch["rollout_log_probs"]
    assert validate_trainable(batch) == 2
    with pytest.raises(
        UntrainableBatchError, match=r"^rollout batch has no column 'rollout_log_probs', and use_tis needs it$"
    ):
        validate_trainable(batch, log_prob_readers=["use_tis"])


def test_a_stored_batch_without_log_probs_is_refused_for_replay_under_a_flag_that_reads_them():
    """A batch generated without log-probs, written and read back by the store's schema (as a
    replay loads it): trainable as it was made, refused naming the column under use_tis."""
    from vime_core.config.derive import rollout_logprob_readers
    from vime_core.storage.schema import batch_to_table, table_to_batch
    from vime_core.storage.synthetic import synthetic_batch

    batch = synthetic_batch(num_groups=1, group_size=2, seed=5)
    batch["rollout_log_probs"] = [[] for _ in batch["tokens"]]
    stored, _ = table_to_batch(batch_to_table(batch, {"run": "r", "rollout_id": 0}))
    assert stored["rollout_log_probs"] == [[], []] and validate_trainable(stored) == 2

    class ReplayConfig:
        use_rollout_logprobs, use_tis, get_mismatch_metrics = False, True, False

    with pytest.raises(
        UntrainableBatchError,
        match=r"^sample 0 \(group 0 index 0, .*\): rollout_log_probs is empty .*use_tis needs them$",
    ):
        validate_trainable(stored, log_prob_readers=rollout_logprob_readers(ReplayConfig()))


def test_a_tool_span_with_loss_mask_0_passes():
    turns = [_span("model", 0, 1), _span("tool", 1, 2)]
    assert validate_trainable(_batch(loss_mask=[[1], [1, 0]], metadata=["{}", json.dumps({"turns": turns})])) == 2
