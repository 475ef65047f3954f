"""A prompt source none of whose rows has the label the reward scores against is refused at load,
naming label_key and the columns the rows have (every reward would be a wrong answer's and every
advantage 0: a run that learns nothing); with the user's own reward function, one warning."""

from __future__ import annotations

import json
import logging

import pytest

from vime_core.config import make_config
from vime_core.data.data_source import read_prompt_rows
from vime_core.data.prompt_checks import LABEL_READING_REWARDS
from vime_core.rewards import BUILTIN_REWARDS


def _source(tmp_path, rows: list[dict]) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]


def test_the_label_reading_rewards_are_built_in_ones():
    assert set(LABEL_READING_REWARDS) <= set(BUILTIN_REWARDS)
    assert set(BUILTIN_REWARDS) - set(LABEL_READING_REWARDS) == {"remote_rm"}  # scores prompt and response


@pytest.mark.parametrize("rm_type", LABEL_READING_REWARDS)
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
