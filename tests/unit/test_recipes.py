"""The recipes under recipes/ parse, derive and validate as the run would read them (no GPU, no
network: nothing here starts a server or resolves a hub id), and their own code works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vime_core.config import load_config
from vime_core.config.derive import dp_size, num_engines, trainer_num_devices
from vime_core.data.sample import Sample

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
ALL = sorted(RECIPES.rglob("*.yaml"))


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"gsm8k_qwen2.5_0.5b_1gpu.yaml", "qwen3_4b_8gpu_colocated.yaml", "config.yaml"}


@pytest.mark.parametrize("path", ALL, ids=[str(p.relative_to(RECIPES)) for p in ALL])
def test_recipe_parses_derives_and_validates(path):
    cfg = load_config(path)
    assert cfg.hf_checkpoint, "a recipe names its model"
    assert cfg.device == "cuda" and cfg.bf16
    assert cfg.global_batch_size == cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.num_steps_per_rollout
    assert cfg.global_batch_size % dp_size(cfg) == 0
    assert cfg.rollout_max_context_len == cfg.rollout_max_prompt_len + cfg.rollout_max_response_len


def test_the_seed_scenario_is_tp2_dp4_with_four_engines_of_two_gpus():
    cfg = load_config(RECIPES / "qwen3_4b_8gpu_colocated.yaml")
    assert (trainer_num_devices(cfg), cfg.tensor_model_parallel_size, dp_size(cfg)) == (8, 2, 4)
    assert cfg.colocate and cfg.rollout_num_gpus == 8
    assert (num_engines(cfg), cfg.rollout_num_gpus_per_engine) == (4, 2)


def test_a_recipe_flag_overrides_the_file():
    cfg = load_config(RECIPES / "gsm8k_qwen2.5_0.5b_1gpu.yaml", {"num_rollout": 3, "lr": 2e-6})
    assert (cfg.num_rollout, cfg.lr) == (3, 2e-6)


def test_custom_reward_recipe_scores_its_prompt_format():
    from vime_core.utils.imports import load_function

    cfg = load_config(RECIPES / "custom_reward" / "config.yaml")
    reward = load_function(cfg.custom_rm_path)
    rows = [json.loads(line) for line in (RECIPES / "custom_reward" / "prompts.jsonl").read_text().splitlines()]
    assert rows and all(r[cfg.input_key][0]["role"] == "system" and r[cfg.label_key] for r in rows)
    label = rows[0][cfg.label_key]
    wrong = str(int(label) + 1)
    assert reward(Sample(response=f"7*12 ... <answer>{label}</answer>", label=label)) == 1.0
    assert reward(Sample(response=f"<answer> {wrong} </answer>", label=label)) == pytest.approx(0.1)
    assert reward(Sample(response=label, label=label)) == 0.0  # right number, wrong format
