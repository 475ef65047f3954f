"""Prompt sources next to JSONL/Parquet: local dataset folders and hub datasets through
`datasets`, the detection rules, exact resume of the cursor for every kind, and
apply_chat_template_kwargs reaching the chat template (training and eval prompts)."""

from __future__ import annotations

import json
import shutil

import pytest

from vime_core.config import ConfigError, load_config
from vime_core.data.data_source import DataSource, load_prompt_rows
from vime_core.data.sources import check_source, resolve_local, source_kind

datasets = pytest.importorskip("datasets")

ROWS = [{"question": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(7)]
HUB_NAME = "vime-test/arith"


class CharTokenizer:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def _cfg(**over):
    base = {
        "rollout_batch_size": 2,
        "n_samples_per_prompt": 2,
        "run_name": "t1",
        "rollout_max_prompt_len": 64,
        "input_key": "question",
        "label_key": "answer",
    }
    base.update(over)
    return load_config(overrides=base)


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """An empty HF datasets cache per test, offline as on these machines (datasets reads both
    settings at import, so its constants are patched too)."""
    cache = tmp_path / "hf-datasets-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _saved_dataset(tmp_path, rows=ROWS):
    path = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _saved_dataset_dict(tmp_path, rows=ROWS):
    path = tmp_path / "saved-dict"
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(ROWS[:2])})
    dd.save_to_disk(str(path))
    return str(path)


def _data_files_folder(tmp_path, rows=ROWS):
    """A folder of data files as on the hub (train/test by file name), read by load_dataset."""
    path = tmp_path / "files"
    path.mkdir()
    _write_jsonl(path / "train.jsonl", rows)
    _write_jsonl(path / "test.jsonl", ROWS[:3])
    return str(path)


def _hub_cache(tmp_path, cache, rows=ROWS):
    """The HF datasets cache as `load_dataset("vime-test/arith", "main")` leaves it after a
    download (<namespace>___<name>/<config>/<version>/<hash>/ with Arrow files and
    dataset_info.json): built with the json builder, then put where the hub download goes."""
    from datasets.packaged_modules.json.json import Json

    src = tmp_path / "hub-src"
    src.mkdir()
    files = {"train": _write_jsonl(src / "train.jsonl", rows), "test": _write_jsonl(src / "test.jsonl", ROWS[:3])}
    builder = Json(cache_dir=str(tmp_path / "scratch"), dataset_name="arith", config_name="main", data_files=files)
    builder.download_and_prepare()
    shutil.copytree(builder.cache_dir, cache / "vime-test___arith" / "main" / "0.0.0" / "0123456789abcdef")
    return HUB_NAME


SOURCES = {
    "jsonl": lambda tmp_path, cache: _write_jsonl(tmp_path / "p.jsonl", ROWS),
    "parquet": lambda tmp_path, cache: _parquet(tmp_path),
    "saved_dataset": lambda tmp_path, cache: _saved_dataset(tmp_path),
    "saved_dataset_dict": lambda tmp_path, cache: _saved_dataset_dict(tmp_path),
    "data_files_folder": lambda tmp_path, cache: _data_files_folder(tmp_path),
    "hub_cache": _hub_cache,
}


def _parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return str(path)


# ---- detection rules ---------------------------------------------------------------------------


def test_source_kind_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.csv").write_text("x\n")
    (tmp_path / "ns" / "name").mkdir(parents=True)
    assert source_kind("s3://bucket/prompts") == "file"  # a URI is always a file
    assert source_kind("file:///data/x.parquet") == "file"
    assert source_kind("openai/gsm8k.jsonl") == "file"  # a file suffix wins over the hub pattern
    assert source_kind("data/train.PARQUET") == "file"
    assert source_kind("folder") == "folder"
    assert source_kind(str(tmp_path / "folder")) == "folder"
    assert source_kind("notes.csv") == "file"  # existing file: "unknown format" later
    assert source_kind("ns/name") == "folder"  # a local folder wins over a hub name
    assert source_kind("openai/gsm8k") == "hub"
    assert source_kind("openai/gsm8k:main") == "hub"
    assert source_kind("gsm8k") == "file"  # hub datasets are namespace/name
    assert source_kind("/abs/missing/path") == "file"
    assert source_kind("a/b/c") == "file"


def test_resolve_local_keeps_hub_names_and_uris(tmp_path):
    (tmp_path / "ns" / "name").mkdir(parents=True)
    assert resolve_local("openai/gsm8k:main", tmp_path) == "openai/gsm8k:main"
    assert resolve_local("ns/name", tmp_path) == str(tmp_path / "ns" / "name")
    assert resolve_local("data/p.jsonl", tmp_path) == str(tmp_path / "data" / "p.jsonl")
    assert resolve_local("s3://b/p.jsonl", tmp_path) == "s3://b/p.jsonl"
    assert resolve_local("", tmp_path) == ""


# ---- each kind reads the same rows --------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_every_kind_reads_the_same_rows(kind, tmp_path, datasets_cache):
    spec = SOURCES[kind](tmp_path, datasets_cache)
    rows = load_prompt_rows(spec, _cfg(), CharTokenizer())
    assert [(r.prompt_id, r.prompt, r.label, r.metadata) for r in rows] == [
        (f"row-{i}", r["question"], r["answer"], {"level": r["level"]}) for i, r in enumerate(ROWS)
    ]
    assert rows[2].tokens == [ord(c) for c in "2+1="]


def test_splits_of_folders_and_hub(tmp_path, datasets_cache):
    for spec in (_saved_dataset_dict(tmp_path), _data_files_folder(tmp_path), _hub_cache(tmp_path, datasets_cache)):
        assert len(load_prompt_rows(spec, _cfg(prompt_data_split="test"))) in (2, 3)
        with pytest.raises(ValueError, match=r"no split 'validation' \(prompt_data_split\)"):
            load_prompt_rows(spec, _cfg(prompt_data_split="validation"))
    # the config name after ':' selects the cached configuration
    assert len(load_prompt_rows(f"{HUB_NAME}:main", _cfg())) == len(ROWS)
    # a save_to_disk folder of one Dataset has no splits: the split setting does not apply
    assert len(load_prompt_rows(_saved_dataset(tmp_path), _cfg(prompt_data_split="test"))) == len(ROWS)


def test_eval_split_through_the_eval_loader(tmp_path):
    spec = _data_files_folder(tmp_path)
    cfg = _cfg(eval_prompt_data=spec, eval_prompt_data_split="test")
    assert len(load_prompt_rows(cfg.eval_prompt_data, cfg, None, cfg.eval_prompt_data_split)) == 3


# ---- bad input ----------------------------------------------------------------------------------


def test_hub_dataset_not_cached_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nobody/nothing.*not in the HF datasets cache .* HF_HUB_OFFLINE=1"):
        load_prompt_rows("nobody/nothing", _cfg())


def test_missing_column_fails_early_naming_the_key(tmp_path, datasets_cache):
    folder = _saved_dataset(tmp_path)
    with pytest.raises(KeyError, match=r"no column 'prompt' \(input_key\); columns: \['answer', 'level', 'question'\]"):
        check_source(folder, "train", "prompt")
    with pytest.raises(KeyError, match=r"eval_prompt_data vime-test/arith \(split 'test'\): no column 'prompt'"):
        check_source(_hub_cache(tmp_path, datasets_cache), "test", "prompt", field="eval_prompt_data")
    check_source(folder, "train", "question")
    check_source(str(tmp_path / "never-read.jsonl"), "train", "prompt")  # files are read by the actors
    with pytest.raises(KeyError, match=r"row 0: no field 'prompt' \(input_key\)"):
        load_prompt_rows(folder, _cfg(input_key="prompt"))


def test_folder_without_data_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: neither a save_to_disk folder nor a folder of data files"):
        load_prompt_rows(str(tmp_path / "empty"), _cfg())


def test_run_config_checks_sources_before_anything_starts(tmp_path, tiny_model_dir, datasets_cache, monkeypatch):
    from vime_core.run_assets import resolve_run_config

    monkeypatch.chdir(tmp_path)
    _hub_cache(tmp_path, datasets_cache)
    base = {"hf_checkpoint": str(tiny_model_dir), "storage_uri": str(tmp_path / "runs")}
    _data_files_folder(tmp_path)
    resolved = resolve_run_config(_cfg(prompt_data=HUB_NAME, eval_prompt_data="files", **base), base=tmp_path)
    assert resolved.prompt_data == HUB_NAME  # a hub name is not turned into a path
    assert resolved.eval_prompt_data == str(tmp_path / "files")
    with pytest.raises(KeyError, match="prompt_data vime-test/arith .*no column 'prompt'"):
        resolve_run_config(_cfg(prompt_data=HUB_NAME, input_key="prompt", **base), base=tmp_path)
    with pytest.raises(FileNotFoundError, match="nobody/nothing"):
        resolve_run_config(_cfg(prompt_data="nobody/nothing", **base), base=tmp_path)


DATASET_KINDS = {  # kind -> (maker, whether the source has splits)
    "saved_dataset": (lambda tmp_path, cache, rows: _saved_dataset(tmp_path, rows), False),
    "saved_dataset_dict": (lambda tmp_path, cache, rows: _saved_dataset_dict(tmp_path, rows), True),
    "data_files_folder": (lambda tmp_path, cache, rows: _data_files_folder(tmp_path, rows), True),
    "hub_cache": (_hub_cache, True),
}


@pytest.mark.parametrize("kind", sorted(DATASET_KINDS))
def test_bad_rows_of_datasets_are_named_with_their_split(kind, tmp_path, datasets_cache):
    """A null and a blank question: refused naming the dataset, its split and the row; dropped
    and counted with drop_bad_prompts (vime_core/data/prompt_checks.py)."""
    bad = {4: None, 5: "  "}  # row -> question
    rows = [{**r, "question": bad.get(i, r["question"])} for i, r in enumerate(ROWS)]
    make, has_splits = DATASET_KINDS[kind]
    spec = make(tmp_path, datasets_cache, rows)
    where = f"{spec} (split 'train')" if has_splits else spec
    with pytest.raises(ValueError) as refused:
        DataSource(_cfg(), spec, tokenizer=CharTokenizer())
    assert str(refused.value).startswith(
        f"prompt data {where}, row 4: the prompt field 'question' is null; 2 of {len(rows)} rows are bad: "
        "1 null (row 4), 1 empty (row 5)"
    )
    src = DataSource(_cfg(drop_bad_prompts=True), spec, tokenizer=CharTokenizer())
    assert [r.prompt_id for r in src.rows] == [f"row-{i}" for i in range(len(rows)) if i not in bad]
    assert src.dropped == {"null": 1, "empty": 1}


# ---- resume of the data cursor, for every kind --------------------------------------------------


def _take(src, calls):
    return [[(s.prompt_id, s.group_index, s.index, s.session_id) for s in g] for k in calls for g in src.get_groups(k)]


@pytest.mark.parametrize("kind", sorted(SOURCES))
def test_cursor_resumes_exactly_for_every_kind(kind, tmp_path, datasets_cache):
    spec = SOURCES[kind](tmp_path, datasets_cache)
    cfg = _cfg(rollout_shuffle=True, seed=5)
    before, after = [2, 3, 2], [3, 4, 2]  # crosses epochs (7 prompts)

    straight = DataSource(cfg, spec, tokenizer=CharTokenizer())
    expected = _take(straight, before + after)

    interrupted = DataSource(cfg, spec, tokenizer=CharTokenizer())
    got = _take(interrupted, before)
    state = json.loads(json.dumps(interrupted.state_dict()))  # as stored in the checkpoint
    resumed = DataSource(cfg, spec, tokenizer=CharTokenizer())
    resumed.load_state_dict(state)
    got += _take(resumed, after)
    assert got == expected
    assert resumed.epoch == straight.epoch >= 1 and resumed.cursor == straight.cursor


# ---- apply_chat_template_kwargs -----------------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}"
)


def test_chat_template_kwargs_reach_the_template(tmp_path, tiny_model_dir, monkeypatch):
    """The embedded model's real tokenizer renders a template that reads a kwarg; what it
    rendered is recorded (its tiny vocabulary cannot spell the markers back)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    tok.chat_template = THINKING_TEMPLATE
    rendered = []
    real = tok.apply_chat_template

    def recording(*args, **kwargs):
        rendered.append(real(*args, **kwargs))
        return rendered[-1]

    monkeypatch.setattr(tok, "apply_chat_template", recording)
    rows = [{"question": "hi", "answer": "a"}, {"question": [{"role": "user", "content": "yo"}], "answer": "b"}]
    path = _write_jsonl(tmp_path / "p.jsonl", rows)

    def texts(**over):
        cfg = _cfg(rollout_max_prompt_len=256, **over)
        rendered.clear()
        src = DataSource(cfg, path, tokenizer=tok)
        train = list(rendered)
        assert src.rows[-1].tokens == tok.encode(train[-1], add_special_tokens=False)
        rendered.clear()
        load_prompt_rows(path, cfg, tok)  # the eval prompts' loader (RolloutManager.eval)
        assert rendered == train
        return train

    assert texts(apply_chat_template=True) == ["<user>hi<assistant>", "<user>yo<assistant>"]
    off = texts(apply_chat_template=True, apply_chat_template_kwargs='{"enable_thinking": false}')
    assert off == ["<user>hi<assistant><no-think>", "<user>yo<assistant><no-think>"]
    # message-list prompts always go through the template, with the kwargs
    assert texts(apply_chat_template_kwargs={"enable_thinking": False}) == ["<user>yo<assistant><no-think>"]


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"enable_thinking": fals', "not JSON"),
        ("[1, 2]", "must be a JSON object.*got list"),
        ('"x"', "must be a JSON object.*got str"),
        ('{"tokenize": true}', r"\['tokenize'\] are set by vime itself"),
    ],
)
def test_bad_chat_template_kwargs_name_the_field(value, message):
    with pytest.raises(ConfigError, match=f"apply_chat_template_kwargs: {message}"):
        _cfg(apply_chat_template_kwargs=value)


def test_chat_template_kwargs_from_the_command_line_and_defaults():
    from vime_core.config import parse_args

    cfg = parse_args(
        ["--apply-chat-template-kwargs", '{"enable_thinking": false, "custom": [1]}', "--prompt-data-split", "test"]
    )
    assert cfg.apply_chat_template_kwargs == {"enable_thinking": False, "custom": [1]}
    assert cfg.prompt_data_split == "test" and cfg.eval_prompt_data_split is None
    default = load_config()
    assert default.apply_chat_template_kwargs == {} and default.prompt_data_split == "train"
