"""The prompt data source: formats, length filter, groups, add-back and exact resume."""

from __future__ import annotations

import json
import logging
import random

import pytest

from vime_core.config import load_config
from vime_core.data.data_source import DataSource, load_prompt_rows
from vime_core.data.sample import Status


class CharTokenizer:
    """One id per character (ord); enough to test the data source without transformers."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


def _cfg(**over):
    base = {"rollout_batch_size": 2, "n_samples_per_prompt": 3, "run_name": "t1", "rollout_max_prompt_len": 64}
    base.update(over)
    return load_config(overrides=base)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": f"{i}+1=", "label": str(i + 1), "prompt_id": f"p{i}", "level": i % 2} for i in range(5)]


@pytest.fixture
def data_file(tmp_path):
    return _write_jsonl(tmp_path / "prompts.jsonl", ROWS)


def test_groups_are_deep_copies_with_counters(data_file):
    src = DataSource(_cfg(rollout_shuffle=False), data_file, tokenizer=CharTokenizer())
    groups = src.get_groups(2)
    assert [len(g) for g in groups] == [3, 3]
    g0 = groups[0]
    assert [s.group_index for s in g0] == [0, 0, 0] and [s.index for s in g0] == [0, 1, 2]
    assert groups[1][0].group_index == 1
    assert g0[0].prompt_id == "p0" and g0[0].label == "1" and g0[0].metadata == {"level": 0}
    assert g0[0].tokens == [ord(c) for c in "0+1="] and g0[0].prompt_length == 4
    assert g0[0].status == Status.PENDING
    ids = {s.session_id for g in groups for s in g}
    assert len(ids) == 6 and all(i.startswith("t1-") for i in ids)
    g0[0].tokens.append(99)
    g0[0].metadata["x"] = 1
    assert g0[1].tokens == [ord(c) for c in "0+1="] and "x" not in g0[1].metadata
    assert src.get_groups(1)[0][0].group_index == 2  # counters keep increasing


def test_epochs_cover_every_prompt_and_shuffle_is_seeded(data_file):
    src = DataSource(_cfg(rollout_shuffle=True, seed=7), data_file, tokenizer=CharTokenizer())
    first_epoch = [g[0].prompt_id for g in src.get_groups(5)]
    assert sorted(first_epoch) == [f"p{i}" for i in range(5)]
    second_epoch = [g[0].prompt_id for g in src.get_groups(5)]
    assert sorted(second_epoch) == sorted(first_epoch) and src.epoch == 1
    again = DataSource(_cfg(rollout_shuffle=True, seed=7), data_file, tokenizer=CharTokenizer())
    assert [g[0].prompt_id for g in again.get_groups(5)] == first_epoch
    for epoch, got in ((0, first_epoch), (1, second_epoch)):  # order = Random(seed + epoch).shuffle
        order = list(range(5))
        random.Random(7 + epoch).shuffle(order)
        assert got == [f"p{i}" for i in order]
    unshuffled = DataSource(_cfg(rollout_shuffle=False), data_file, tokenizer=CharTokenizer())
    assert [g[0].prompt_id for g in unshuffled.get_groups(5)] == [f"p{i}" for i in range(5)]


def test_json_array_file(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ROWS[:2]))
    assert [r.prompt_id for r in load_prompt_rows(str(path), _cfg())] == ["p0", "p1"]


def test_prompt_length_filter_drops_and_logs(tmp_path, caplog):
    rows = [{"prompt": "x" * n, "label": "a"} for n in (3, 10, 4, 11)]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.INFO, logger="vime_core.data.data_source"):
        src = DataSource(_cfg(rollout_max_prompt_len=4), path, tokenizer=CharTokenizer())
    assert len(src) == 2
    assert [r.prompt_id for r in src.rows] == ["row-0", "row-2"]  # ids from the original row index
    assert "dropped 2 of 4" in caplog.text and "rollout_max_prompt_len=4" in caplog.text
    with pytest.raises(ValueError, match="no prompt fits rollout_max_prompt_len=2"):
        DataSource(_cfg(rollout_max_prompt_len=2), path, tokenizer=CharTokenizer())


def test_chat_template_and_message_prompts(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}, {"prompt": [{"role": "user", "content": "yo"}]}])
    src = DataSource(_cfg(apply_chat_template=True), path, tokenizer=CharTokenizer())
    texts = ["".join(chr(t) for t in r.tokens) for r in src.rows]
    assert texts == ["<user>hi<assistant>", "<user>yo<assistant>"]
    assert src.rows[0].label is None


def test_parquet_and_custom_keys(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["1+1=", "2+2="], "answer": ["2", "4"]}), path)
    rows = load_prompt_rows(str(path), _cfg(input_key="question", label_key="answer"), CharTokenizer())
    assert [(r.prompt_id, r.prompt, r.label) for r in rows] == [("row-0", "1+1=", "2"), ("row-1", "2+2=", "4")]
    with pytest.raises(KeyError, match=r"row 0: no field 'prompt' \(input_key\)"):
        load_prompt_rows(str(path), _cfg(), CharTokenizer())


def test_fsspec_uri(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    rows = load_prompt_rows(f"file://{path}", _cfg())
    assert len(rows) == 5 and rows[0].tokens == []  # no tokenizer: not tokenised, not filtered


def test_bad_files_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl, line 2: not JSON"):
        load_prompt_rows(str(bad), _cfg())
    with pytest.raises(FileNotFoundError, match="missing.jsonl does not exist"):
        load_prompt_rows(str(tmp_path / "missing.jsonl"), _cfg())
    with pytest.raises(ValueError, match="unknown format"):
        load_prompt_rows(str(tmp_path / "x.csv"), _cfg())
    with pytest.raises(ValueError, match="prompt_data is empty"):
        DataSource(_cfg(), None, tokenizer=CharTokenizer())


def test_add_back_hands_returned_samples_out_first(data_file):
    src = DataSource(_cfg(rollout_shuffle=False), data_file, tokenizer=CharTokenizer())
    g0, g1 = src.get_groups(2)
    g1[0].append_response_tokens([5, 6], [-0.1, -0.2])
    g1[0].status = Status.ABORTED
    src.add_back(g1)  # a flat list of samples, regrouped by group_index
    out = src.get_groups(2)
    assert out[0] is not None and out[0][0].group_index == 1 and out[0][0].response_length == 2
    assert out[1][0].group_index == 2  # then a new prompt
    src.add_back([g0])  # a list of groups
    assert src.get_groups(1)[0] == g0


def _drain(src, calls):
    seen = []
    for k in calls:
        for g in src.get_groups(k):
            seen.append([(s.prompt_id, s.group_index, s.index, s.session_id, s.response_length) for s in g])
    return seen


def test_resume_equals_uninterrupted(data_file):
    cfg = _cfg(rollout_shuffle=True, seed=3)
    plan_before, plan_after = [2, 3], [4, 2, 3]

    straight = DataSource(cfg, data_file, tokenizer=CharTokenizer())
    first = _drain(straight, plan_before)
    aborted = straight.get_groups(1)
    aborted[0][0].append_response_tokens([7], [-0.5])
    straight.add_back(aborted)
    expected = first + _drain(straight, plan_after)

    interrupted = DataSource(cfg, data_file, tokenizer=CharTokenizer())
    got = _drain(interrupted, plan_before)
    aborted2 = interrupted.get_groups(1)
    aborted2[0][0].append_response_tokens([7], [-0.5])
    interrupted.add_back(aborted2)
    state = json.loads(json.dumps(interrupted.state_dict()))  # survives a JSON round trip
    resumed = DataSource(cfg, data_file, tokenizer=CharTokenizer())
    resumed.load_state_dict(state)
    got += _drain(resumed, plan_after)
    assert got == expected
    assert resumed.epoch == straight.epoch >= 1


def test_state_for_other_data_is_rejected(data_file, tmp_path):
    src = DataSource(_cfg(), data_file, tokenizer=CharTokenizer())
    other = DataSource(_cfg(), _write_jsonl(tmp_path / "o.jsonl", ROWS[:3]), tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="saved for .*prompts.jsonl"):
        other.load_state_dict(src.state_dict())


def test_real_hf_tokenizer_from_checkpoint(tiny_model_dir, data_file):
    from transformers import AutoTokenizer

    src = DataSource(_cfg(hf_checkpoint=str(tiny_model_dir)), data_file)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert src.rows[0].tokens == tok.encode(ROWS[0]["prompt"])
    assert tok.decode(src.rows[0].tokens) == ROWS[0]["prompt"]
