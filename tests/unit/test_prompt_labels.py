"""A prompt source none of whose rows has the label the reward scores against is refused at load,
naming label_key and the columns the rows have (every reward would be a wrong answer's and every
advantage 0: a run that learns nothing); with the user's own reward function, one warning."""

from __future__ import annotations

import json
import logging

import pytest

from vime_core.config import make_config
from vime_core.data.data_source import read_prompt_rows
from vime_core.builtin_rewards import BUILTIN_REWARDS, LABEL_READING_REWARDS
from vime_core.utils.imports import load_function


def _source(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_every_built_in_reward_loads_and_all_but_the_remote_model_read_the_label():
    for name, reward in BUILTIN_REWARDS.items():
        assert name == "remote_rm" or callable(load_function(reward.function, field="rm_type"))
    assert set(BUILTIN_REWARDS) - LABEL_READING_REWARDS == {"remote_rm"}  # scores prompt and response


@pytest.mark.parametrize("rm_type", sorted(LABEL_READING_REWARDS))
def test_a_source_without_the_label_is_refused_naming_the_key(tmp_path, rm_type):
    cfg = make_config({"rm_type": rm_type})
    with pytest.raises(
        ValueError, match=r"no row has label_key 'label' \(its columns: answer, prompt\).*set --label-key"
    ):
        read_prompt_rows(_source(tmp_path, ROWS), cfg)
    labelled = read_prompt_rows(_source(tmp_path, ROWS), make_config({"rm_type": rm_type, "label_key": "answer"}))
    assert [row.label for row in labelled.rows] == [r["answer"] for r in ROWS]


def test_the_users_own_reward_gets_one_warning(tmp_path, caplog):
    cfg = make_config({"custom_rm_path": "vime_core.demo.task:reward"})
    with caplog.at_level(logging.WARNING, logger="vime_core.data.prompt_checks"):
        loaded = read_prompt_rows(_source(tmp_path, ROWS), cfg)
    assert len(loaded.rows) == len(ROWS) and all(row.label is None for row in loaded.rows)
    assert [r.message for r in caplog.records if "no row has label_key" in r.message] != []
