"""The embedded demo's settings, as data: a configuration that names no model runs the demo (a tiny
model learning addition on the CPU), and these values apply to every field it does not set. A leaf:
the configuration reads it, and vime_core/demo/ imports the configuration."""

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
