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
# Recipes for the CPU name no model: they run the embedded tiny one with the demo's settings.
CPU = [p for p in ALL if p.stem.startswith("cpu")]
GPU = [p for p in ALL if p not in CPU]


def test_there_are_recipes():
    assert {p.name for p in ALL} >= {"gsm8k_qwen2.5_0.5b_1gpu.yaml", "qwen3_4b_8gpu_colocated.yaml", "config.yaml"}


@pytest.mark.parametrize("path", GPU, ids=[str(p.relative_to(RECIPES)) for p in GPU])
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


@pytest.mark.parametrize("path", CPU, ids=[str(p.relative_to(RECIPES)) for p in CPU])
def test_cpu_recipe_runs_the_embedded_model(path):
    cfg = load_config(path)
    assert not cfg.hf_checkpoint and cfg.device == "cpu" and not cfg.bf16
    assert cfg.global_batch_size == cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.num_steps_per_rollout
    assert cfg.global_batch_size % dp_size(cfg) == 0


def test_tool_use_recipes_share_their_hooks_and_prompt_files():
    """The CPU and GPU tool-use recipes load the same hooks; their prompt files exist and are
    what recipes/tool_use/prompts.py writes, each label the value of its expression."""
    from recipes.tool_use import prompts
    from recipes.tool_use.calculator import evaluate
    from vime_core.utils.imports import load_function

    folder = RECIPES / "tool_use"
    cpu, gpu = load_config(folder / "cpu_tiny.yaml"), load_config(folder / "gpu_qwen2.5_0.5b.yaml")
    for cfg in (cpu, gpu):
        assert cfg.custom_generate_function_path == "recipes.tool_use.calculator:generate"
        load_function(cfg.custom_generate_function_path)
        load_function(cfg.custom_rm_path)
    assert RECIPES.parent / cpu.prompt_data == prompts.TINY and RECIPES.parent / gpu.prompt_data == prompts.GPU
    assert prompts.TINY.read_text() == prompts.render(prompts.tiny_rows())
    assert prompts.GPU.read_text() == prompts.render(prompts.gpu_rows())
    tiny = [json.loads(line) for line in prompts.TINY.read_text().splitlines()]
    assert all(len(r["prompt"]) < cpu.rollout_max_prompt_len and str(evaluate(r["prompt"])) == r["label"] for r in tiny)
    assert set("".join(r["prompt"] + r["label"] for r in tiny)) <= set("0123456789+-*")  # the tiny alphabet
