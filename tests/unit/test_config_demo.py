"""The embedded demo's settings apply only while no model is named; the schema's own defaults are
the ones for real models (vime_core/demo/settings.py)."""

from __future__ import annotations

from vime_core.config import VimeConfig, load_config, make_config
from vime_core.demo.settings import DEMO_SETTINGS, demo_config
from vime_core.config.loader import build_parser

REAL_DEFAULTS = {name: VimeConfig.model_fields[name].default for name in DEMO_SETTINGS}


def test_every_demo_setting_differs_from_the_real_default():
    assert DEMO_SETTINGS and all(DEMO_SETTINGS[k] != REAL_DEFAULTS[k] for k in DEMO_SETTINGS), REAL_DEFAULTS


def test_no_model_named_gets_the_demo_settings():
    cfg = load_config()
    assert {k: getattr(cfg, k) for k in DEMO_SETTINGS} == DEMO_SETTINGS
    assert cfg.vllm_enforce_eager is True  # derived from the demo's device


def test_a_named_model_gets_the_real_defaults():
    cfg = make_config({"hf_checkpoint": "org/model"})
    assert {k: getattr(cfg, k) for k in DEMO_SETTINGS} == REAL_DEFAULTS
    assert cfg.device == "cuda" and cfg.vllm_enforce_eager is False
    assert cfg.rollout_max_context_len == cfg.rollout_max_prompt_len + cfg.rollout_max_response_len


def test_a_set_value_wins_over_the_demo_and_over_the_real_default():
    demo = make_config({"lr": 5e-4, "device": "cpu"})
    assert demo.lr == 5e-4 and demo.rollout_max_response_len == DEMO_SETTINGS["rollout_max_response_len"]
    real = make_config({"hf_checkpoint": "org/model", "device": "cpu", "vllm_enforce_eager": False})
    assert real.device == "cpu" and real.vllm_enforce_eager is False and real.lr == REAL_DEFAULTS["lr"]


def test_a_dumped_config_reads_back_the_same_with_or_without_a_model():
    for cfg in (load_config(), make_config({"hf_checkpoint": "org/model"}), demo_config(hf_checkpoint="/m")):
        assert make_config(cfg.model_dump()) == cfg


def test_help_names_both_defaults():
    text = build_parser().format_help()
    flat = " ".join(text.split())
    assert f"(default: {REAL_DEFAULTS['lr']}; the embedded demo's: {DEMO_SETTINGS['lr']})" in flat
