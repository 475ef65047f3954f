"""The routing-replay flag: slime's name, off by default (Megatron's MoE fields as before), refused at
configuration time while the engine side is missing, refused on a dense model at trainer start, each
in one line naming the flag."""

from __future__ import annotations

import pytest

from tests.moe_tiny import tiny_moe_config
from vime_core.config import ConfigError, load_config, parse_args
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


def test_slimes_flag_is_refused_until_the_engine_side_exists():
    with pytest.raises(ConfigError, match="use_rollout_routing_replay=true: the engine side .* not built yet") as err:
        load_config(overrides={"use_rollout_routing_replay": True})
    # ConfigError heads its list of causes with "invalid configuration:"; this cause is one line
    assert str(err.value).splitlines()[-1].strip().startswith("use_rollout_routing_replay=true: the engine side")
    with pytest.raises(SystemExit):  # the CLI spelling reaches the same check
        parse_args(["--use-rollout-routing-replay", "true"])


def test_a_dense_model_refuses_it_naming_the_flag():
    cfg = load_config()
    cfg.use_rollout_routing_replay = True  # past the configuration check, as the trainer will see it
    check_routing_replay(MOE, cfg)
    with pytest.raises(ValueError, match=r"^use_rollout_routing_replay=true: the model \(model_type='qwen3'\)") as err:
        check_routing_replay(DENSE, cfg)
    assert "\n" not in str(err.value)
