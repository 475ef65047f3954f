"""The routing-replay flag: slime's name, off by default (Megatron's MoE fields as before); on the CPU
it needs an eager engine addressed directly (refused at configuration time otherwise), the engines
get the capture's server options, a dense model refuses it at trainer start; each error one line
naming the flag."""

from __future__ import annotations

import pytest

from tests.moe_tiny import tiny_moe_config
from vime_core.config import ConfigError, engine_server_args, load_config, parse_args
from vime_core.config.derive import routing_capture_server_args
from vime_core.trainer.model import architecture_from_hf, check_routing_replay, moe_settings

MOE = architecture_from_hf(tiny_moe_config())
DENSE = architecture_from_hf(tiny_moe_config() | {"model_type": "qwen3"})


def test_off_by_default_leaves_megatrons_fields_as_they_were():
    cfg = load_config()
    assert cfg.use_rollout_routing_replay is False
    assert "moe_enable_routing_replay" not in moe_settings(MOE, 1)
    assert moe_settings(MOE, 1, routing_replay=False) == moe_settings(MOE, 1)
    check_routing_replay(DENSE, cfg)  # the default is fine on a dense model


def test_on_turns_on_megatrons_routing_replay_for_moe_only():
    on = moe_settings(MOE, 2, routing_replay=True)
    assert on.pop("moe_enable_routing_replay") is True
    assert on == moe_settings(MOE, 2)
    assert moe_settings(DENSE, 2, routing_replay=True) == {}


def test_on_the_cpu_it_needs_an_eager_engine_in_one_line():
    values = {"use_rollout_routing_replay": True, "vllm_enforce_eager": False}
    message = "on device=cpu needs vllm_enforce_eager=true: a compiled engine forward"
    with pytest.raises(ConfigError, match=message) as err:
        load_config(overrides=values)
    # ConfigError heads its list of causes with "invalid configuration:"; this cause is one line
    assert str(err.value).splitlines()[-1].strip().startswith("use_rollout_routing_replay=true on device=cpu")
    for router in ("true", "false"):  # behind vllm-router too: each engine is asked for its rows
        cfg = parse_args(["--use-rollout-routing-replay", "true", "--use-router", router])  # the CLI spelling
        assert cfg.use_rollout_routing_replay and cfg.vllm_enforce_eager  # derived: eager on the CPU


def test_engines_capture_the_routing_the_releases_way():
    cpu = load_config(overrides={"use_rollout_routing_replay": True, "use_router": False})
    off = load_config()
    assert routing_capture_server_args(off) == {}
    assert engine_server_args(off).keys() == engine_server_args(cpu).keys() - {"no_enable_prefix_caching"}
    assert engine_server_args(cpu)["no_enable_prefix_caching"] is True  # every prompt token forwarded
    cuda = cpu.model_copy(update={"device": "cuda"})
    assert routing_capture_server_args(cuda) == {"enable_return_routed_experts": True}  # vLLM's own capture


def test_a_dense_model_refuses_it_naming_the_flag():
    cfg = load_config()
    cfg.use_rollout_routing_replay = True  # past the configuration check, as the trainer will see it
    check_routing_replay(MOE, cfg)
    with pytest.raises(ValueError, match=r"^use_rollout_routing_replay=true: the model \(model_type='qwen3'\)") as err:
        check_routing_replay(DENSE, cfg)
    assert "\n" not in str(err.value)
