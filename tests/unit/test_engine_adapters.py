"""Adapter serving without a server: names that carry versions, the LoRA server options an
adapter-publishing run's engines get, and the check of an adapter against an engine's weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vime_core.engines.adapters import (
    RUNTIME_UPDATES_ENV,
    VLLM_LORA_RANKS,
    adapter_name,
    adapter_version,
    lora_server_args,
    serves_adapters,
)
from vime_core.weight_sync.adapter_publish import check_adapter_against_spec
from vime_core.weight_sync.weight_spec import WeightSpecError


def test_names_carry_the_version():
    for version in (1, 7, 1234):
        assert adapter_version(adapter_name(version)) == version
    assert adapter_version("/models/base") is None
    assert adapter_version(adapter_name(3) + "x") is None


@pytest.mark.parametrize("rank", [1, 4, 8, 9, 64, 65, 320, 512])
def test_max_lora_rank_is_the_smallest_vllm_rank_that_fits(rank):
    args = lora_server_args(rank)
    assert args["enable_lora"] is True and args["max_loras"] <= args["max_cpu_loras"]
    assert args["max_lora_rank"] in VLLM_LORA_RANKS and args["max_lora_rank"] >= rank
    assert not [r for r in VLLM_LORA_RANKS if rank <= r < args["max_lora_rank"]]


@pytest.mark.parametrize("rank", [0, -1, VLLM_LORA_RANKS[-1] + 1])
def test_ranks_vllm_cannot_serve_name_the_field(rank):
    with pytest.raises(ValueError, match=f"lora_rank={rank}"):
        lora_server_args(rank)


def test_only_adapter_publishes_with_a_rank_serve_adapters():
    assert serves_adapters(SimpleNamespace(lora_publish="adapter", lora_rank=8))
    assert not serves_adapters(SimpleNamespace(lora_publish="merged", lora_rank=8))
    assert not serves_adapters(SimpleNamespace(lora_publish="adapter", lora_rank=0))
    assert not serves_adapters(SimpleNamespace())  # a configuration without the LoRA section


def test_engine_command_and_environment(tiny_model_dir, vllm_python):
    from tests.integration.publish.conftest import make_cfg
    from vime_core.engines.server import EngineServer

    cfg = make_cfg(tiny_model_dir, vllm_python)
    plain = EngineServer(cfg, 0)
    assert "--enable-lora" not in plain.command(1234)
    assert not RUNTIME_UPDATES_ENV.keys() & plain.environment().keys()

    adapters = EngineServer(cfg.model_copy(update={"lora_publish": "adapter", "lora_rank": 12}), 0)
    cmd = adapters.command(1234)
    assert "--enable-lora" in cmd
    assert cmd[cmd.index("--max-lora-rank") + 1] == "16"
    assert int(cmd[cmd.index("--max-cpu-loras") + 1]) >= int(cmd[cmd.index("--max-loras") + 1])
    assert RUNTIME_UPDATES_ENV.items() <= adapters.environment().items()


SPEC = {"tensors": {"model.layers.0.self_attn.q_proj.weight": {"shape": [6, 4], "dtype": "float32"}}}
KEY = "base_model.model.model.layers.0.self_attn.q_proj"


def test_adapter_checked_against_the_engines_weights():
    good = {f"{KEY}.lora_A.weight": torch.zeros(2, 4), f"{KEY}.lora_B.weight": torch.zeros(6, 2)}
    assert check_adapter_against_spec(good, SPEC, "engine-0") == {"model.layers.0.self_attn.q_proj.weight": [6, 4]}
    wide = {**good, f"{KEY}.lora_A.weight": torch.zeros(2, 5)}
    with pytest.raises(WeightSpecError, match=r"engine engine-0: adapter of .*q_proj.weight' is \[6, 5\]"):
        check_adapter_against_spec(wide, SPEC, "engine-0")
    other = {k.replace("q_proj", "k_proj"): v for k, v in good.items()}
    with pytest.raises(WeightSpecError, match="no weight 'model.layers.0.self_attn.k_proj.weight'"):
        check_adapter_against_spec(other, SPEC, "engine-0")
