"""The embedded demo's settings, as data (a leaf: the configuration reads it, imports nothing;
vime_core/demo/ imports the configuration, so the table lives here).

A configuration that names no model (`hf_checkpoint` empty) runs the embedded demo: a tiny
Qwen3-style model learning single-digit addition on the CPU (vime_core/run_assets.py builds it).
The schema's defaults are for real models on GPUs (slime's values); the demo needs others, and
they apply to every field of this table the configuration does not set itself. A flag or a
config-file value always wins. vime_core/demo/settings.py adds `demo_config`, which makes one.
"""

from __future__ import annotations

from typing import Any

DEMO_SETTINGS: dict[str, Any] = {
    "device": "cpu",
    "lr": 1e-3,  # a freshly initialised 0.33M-parameter model, not a pretrained one
    "n_samples_per_prompt": 16,
    "rollout_max_prompt_len": 16,  # "a+b=" and its BOS
    "rollout_max_response_len": 4,  # the sum and EOS
    "micro_batch_size": 32,
    "entropy_coef": 0.01,  # keeps the tiny model exploring; with none it can settle on a wrong answer
}


def with_demo_settings(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with the demo's settings under them when they name no model."""
    return values if values.get("hf_checkpoint") else demo_values(values)


def demo_values(values: dict[str, Any]) -> dict[str, Any]:
    """`values` over the demo's settings, whatever model they name: tests and benchmarks that
    run the tiny model from a prebuilt folder."""
    return {**DEMO_SETTINGS, **values}
