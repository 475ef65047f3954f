"""The prompt data source: formats, length filter, groups, add-back and exact resume."""

from __future__ import annotations

import json
import logging
import random
import re

import pytest

from vime_core.config import load_config
from vime_core.data.data_source import DataSource, load_prompt_rows
from vime_core.data.sample import Status


class CharTokenizer:
    """One id per character (ord); enough to test the data source without transformers."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )


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


# ---- bad prompt rows (vime_core/data/prompt_checks.py) -----------------------------------------

SECRET = "SECRET"  # in every bad row's prompt: no message may carry a prompt's text
MAX_LEN = 20
MESSAGES = [{"role": "user", "content": "hi"}]


def _templated_length(prompt):
    """Tokens of a prompt by CharTokenizer, through its chat template for a message list."""
    return len(CharTokenizer().apply_chat_template(prompt)) if isinstance(prompt, list) else len(prompt)


TOO_LONG, TOO_LONG_TEMPLATED = SECRET * 5, [{"role": "user", "content": SECRET}]  # 6 tokens before the template
# kind -> (the bad prompt, or MISSING for a row without the field; the reason it is counted under;
# what the one-line refusal says about it)
MISSING = object()
BAD = {
    "null": (None, "null", "the prompt field 'prompt' is null"),
    "missing": (MISSING, "missing", r"no field 'prompt' \(input_key\)"),
    "empty": ("", "empty", "the prompt field 'prompt' is empty or only whitespace"),
    "whitespace": (" \n\t ", "empty", "the prompt field 'prompt' is empty or only whitespace"),
    "no_messages": ([], "empty", "the prompt field 'prompt' is an empty list of messages"),
    "number": (17, "not text", "the prompt field 'prompt' is of type int, not text or a list of chat messages"),
    "bool": (True, "not text", "is of type bool, not text"),
    "dict": ({"role": "user", "content": SECRET}, "not text", "is of type dict, not text"),
    "list_of_text": ([SECRET, "x"], "not text", "is a list but not of chat messages"),
    "too_long": (
        TOO_LONG,
        "too long",
        f"has {_templated_length(TOO_LONG)} tokens, more than rollout_max_prompt_len={MAX_LEN}",
    ),
    "too_long_templated": (
        TOO_LONG_TEMPLATED,
        "too long",
        f"has {_templated_length(TOO_LONG_TEMPLATED)} tokens after "
        f"the chat template, more than rollout_max_prompt_len={MAX_LEN}",
    ),
}


def _row(prompt, i):
    row = {"label": f"{SECRET}-label-{i}", "prompt_id": f"p{i}"}
    return row if prompt is MISSING else {"prompt": prompt, **row}


def _clean(n):
    return [_row(f"{i}+1=", i) if i % 2 else _row(MESSAGES, i) for i in range(n)]


def test_the_bad_kinds_are_bad_and_the_clean_rows_fit():
    assert _templated_length(TOO_LONG) > MAX_LEN and len(SECRET) <= MAX_LEN < _templated_length(TOO_LONG_TEMPLATED)
    assert all(_templated_length(r["prompt"]) <= MAX_LEN for r in _clean(6))


@pytest.mark.parametrize("kind", sorted(BAD))
def test_each_bad_prompt_is_refused_naming_file_and_row(kind, tmp_path, caplog):
    prompt, _, says = BAD[kind]
    rows = _clean(6)
    bad_at = 3
    rows[bad_at] = _row(prompt, bad_at)
    path = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    error = KeyError if kind == "missing" else ValueError
    with caplog.at_level(logging.INFO), pytest.raises(error) as refused:
        DataSource(_cfg(rollout_max_prompt_len=MAX_LEN), path, tokenizer=CharTokenizer())
    message = str(refused.value)
    assert re.search(f"prompt data {re.escape(path)}, row {bad_at}: .*{says}", message), message
    assert "1 of 6 rows is bad" in message and "--drop-bad-prompts" in message and "\n" not in message
    assert SECRET not in message and SECRET not in caplog.text
    from vime_core.faults import CONFIGURATION, classify

    fault = classify(refused.value)  # a data error: the train flow does not retry it
    assert fault.kind == CONFIGURATION and not fault.retryable


def test_drop_bad_prompts_drops_exactly_the_bad_rows_and_counts_them(tmp_path, caplog):
    rows = _clean(3 * len(BAD))
    bad_rows = {3 * j + 1: kind for j, kind in enumerate(sorted(BAD))}  # row -> kind
    for i, kind in bad_rows.items():
        rows[i] = _row(BAD[kind][0], i)
    path = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    cfg = _cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=True, rollout_shuffle=False)
    with caplog.at_level(logging.INFO):
        src = DataSource(cfg, path, tokenizer=CharTokenizer())
    kept = [r for i, r in enumerate(rows) if i not in bad_rows]
    assert [r.prompt_id for r in src.rows] == [r["prompt_id"] for r in kept]
    assert [r.prompt for r in src.rows] == [r["prompt"] for r in kept]
    expected = {}
    for kind in bad_rows.values():
        expected[BAD[kind][1]] = expected.get(BAD[kind][1], 0) + 1
    assert src.dropped == expected and src.state_dict()["dropped_rows"] == expected
    assert src.state_dict()["num_rows"] == len(rows) - len(bad_rows)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    line = warnings[0].getMessage()
    assert f"dropped {len(bad_rows)} of {len(rows)} rows (drop_bad_prompts)" in line
    for reason, count in expected.items():
        first = [i for i, kind in sorted(bad_rows.items()) if BAD[kind][1] == reason]
        assert f"({'rows' if count > 1 else 'row'} {', '.join(map(str, first[:5]))}" in line
    assert f"{expected['null']} null (row " in line
    assert f"{expected['too long']} longer than rollout_max_prompt_len={MAX_LEN} tokens (rows " in line
    assert SECRET not in caplog.text
    # every group handed out comes from a kept row
    handed = {s.prompt_id for g in src.get_groups(2 * len(kept)) for s in g}
    assert handed == {r["prompt_id"] for r in kept}


def test_clean_data_loads_unchanged_in_either_mode(tmp_path, caplog):
    rows = _clean(6)
    path = _write_jsonl(tmp_path / "prompts.jsonl", rows)
    tok = CharTokenizer()
    text = [tok.apply_chat_template(r["prompt"]) if isinstance(r["prompt"], list) else r["prompt"] for r in rows]
    expected = [(r["prompt_id"], r["prompt"], r["label"], [ord(c) for c in t]) for r, t in zip(rows, text)]
    states = []
    for drop in (False, True):
        with caplog.at_level(logging.WARNING):
            src = DataSource(_cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=drop), path, tokenizer=tok)
        assert [(r.prompt_id, r.prompt, r.label, r.tokens) for r in src.rows] == expected
        assert src.dropped == {} and caplog.text == ""
        states.append(src.state_dict())
    assert states[0] == states[1]  # the same fingerprint: a run may turn drop_bad_prompts on and resume


def test_bad_prompts_in_parquet_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = ["1+1=", None, "2+2=", "   ", SECRET * 5, ""]
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": prompts, "label": [str(i) for i in range(len(prompts))]}), path)
    with pytest.raises(ValueError, match=r"p\.parquet, row 1: the prompt field 'prompt' is null; 4 of 6 rows are") as e:
        DataSource(_cfg(rollout_max_prompt_len=MAX_LEN), str(path), tokenizer=CharTokenizer())
    assert SECRET not in str(e.value)
    src = DataSource(_cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=True), str(path), tokenizer=CharTokenizer())
    assert [r.prompt_id for r in src.rows] == ["row-0", "row-2"]  # ids from the original row numbers
    assert src.dropped == {"null": 1, "empty": 2, "too long": 1}
    ints = tmp_path / "ints.parquet"
    pq.write_table(pa.table({"prompt": [1, 2]}), ints)
    with pytest.raises(ValueError, match=r"ints\.parquet, row 0: the prompt field 'prompt' is of type int"):
        load_prompt_rows(str(ints), _cfg())  # without a tokenizer too: the checks that need none


def test_every_row_bad_fails_in_either_mode(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [_row(None, 0), _row("", 1), _row(TOO_LONG, 2)])
    for drop, match in ((True, "every row is bad, no prompt left"), (False, "row 0: .*is null; 3 of 3 rows are bad")):
        with pytest.raises(ValueError, match=match) as e:
            DataSource(_cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=drop), path, tokenizer=CharTokenizer())
        summary = f"1 null (row 0), 1 empty (row 1), 1 longer than rollout_max_prompt_len={MAX_LEN} tokens (row 2)"
        assert summary in str(e.value)
        assert SECRET not in str(e.value)
    wrong_key = _write_jsonl(tmp_path / "q.jsonl", [{"question": SECRET}] * 2)
    with pytest.raises(ValueError, match=r"every row is bad.*2 without field 'prompt'.*fields: \['question'\]"):
        load_prompt_rows(wrong_key, _cfg(drop_bad_prompts=True))
    (tmp_path / "none.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="none.jsonl: no rows"):
        load_prompt_rows(str(tmp_path / "none.jsonl"), _cfg(drop_bad_prompts=True))


def test_eval_loader_follows_the_same_rules(tmp_path):
    """RolloutManager.eval loads eval_prompt_data with load_prompt_rows and the tokenizer."""
    rows = _clean(4)
    rows[2] = _row(TOO_LONG, 2)
    path = _write_jsonl(tmp_path / "eval.jsonl", rows)
    says = f"has {len(TOO_LONG)} tokens, more than rollout_max_prompt_len={MAX_LEN}"
    with pytest.raises(ValueError, match=rf"eval\.jsonl, row 2: .*{says}"):
        load_prompt_rows(path, _cfg(rollout_max_prompt_len=MAX_LEN), CharTokenizer())
    kept = load_prompt_rows(path, _cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=True), CharTokenizer())
    assert [r.prompt_id for r in kept] == ["p0", "p1", "p3"]


def test_some_rows_without_a_label_are_warned_about(tmp_path, caplog):
    rows = _clean(8)
    for i in (2, 5):
        del rows[i]["label"]
    rows[6]["label"] = None
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        src = DataSource(_cfg(rollout_max_prompt_len=MAX_LEN), path, tokenizer=CharTokenizer())
    assert [r.label is None for r in src.rows] == [i in (2, 5, 6) for i in range(8)]
    assert "rows 2, 5, 6 (3 of 8 prompts) have no label (label_key 'label')" in caplog.text
    caplog.clear()
    unlabelled = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "1+1="}, {"prompt": "2+2="}])
    # no labels at all: refused with a built-in reward that scores against them
    # (tests/unit/test_prompt_labels.py), one line with the user's own reward function
    own = _cfg(rollout_max_prompt_len=MAX_LEN, custom_rm_path="vime_core.demo.task:reward")
    with caplog.at_level(logging.WARNING):
        DataSource(own, unlabelled, tokenizer=CharTokenizer())
    assert caplog.text.count("no row has label_key 'label' (its columns: prompt)") == 1


def test_resume_with_dropped_rows_is_exact_and_refuses_other_drops(tmp_path):
    rows = _clean(9)
    for i, kind in ((1, "null"), (4, "too_long"), (7, "number")):
        rows[i] = _row(BAD[kind][0], i)
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    cfg = _cfg(rollout_max_prompt_len=MAX_LEN, drop_bad_prompts=True, rollout_shuffle=True, seed=4)
    plan_before, plan_after = [2, 3], [4, 3]  # crosses an epoch of 6 kept prompts

    straight = DataSource(cfg, path, tokenizer=CharTokenizer())
    expected = _drain(straight, plan_before + plan_after)
    interrupted = DataSource(cfg, path, tokenizer=CharTokenizer())
    got = _drain(interrupted, plan_before)
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = DataSource(cfg, path, tokenizer=CharTokenizer())
    resumed.load_state_dict(state)
    got += _drain(resumed, plan_after)
    assert got == expected and resumed.epoch == straight.epoch >= 1
    # a longer limit keeps row 4: other rows, so the saved cursor would point elsewhere
    longer_cfg = _cfg(rollout_max_prompt_len=len(TOO_LONG), drop_bad_prompts=True)
    longer = DataSource(longer_cfg, path, tokenizer=CharTokenizer())
    assert len(longer) == len(straight) + 1 == len(rows) - 2
    with pytest.raises(
        ValueError,
        match=rf"{len(rows) - 3} prompts, 3 rows dropped \(1 null, 1 too long, 1 not text\)"
        rf".*{len(rows) - 2} prompts, 2 rows dropped \(1 null, 1 not text\)",
    ):
        longer.load_state_dict(state)


def test_chat_template_and_message_prompts(tmp_path):
    rows = [{"prompt": "hi", "label": "a"}, {"prompt": [{"role": "user", "content": "yo"}], "label": "b"}]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    src = DataSource(_cfg(apply_chat_template=True), path, tokenizer=CharTokenizer())
    texts = ["".join(chr(t) for t in r.tokens) for r in src.rows]
    assert texts == ["<user>hi<assistant>", "<user>yo<assistant>"]
    assert [r.label for r in src.rows] == ["a", "b"]


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
