"""The MoE router-loss flags: parsed under Megatron's names, checked at configuration time (a
coefficient without a loss type), passed to Megatron's MoE fields, and refused on a dense model in one
line naming the flag."""

from __future__ import annotations

import pytest

from tests.moe_tiny import tiny_moe_config
from vime_core.config import ConfigError, load_config, parse_args
from vime_core.trainer.model import (
    ROUTER_LOSS_DEFAULTS,
    architecture_from_hf,
    check_router_losses,
    moe_settings,
    router_loss_settings,
)
from vime_core.trainer.router_losses import router_loss_metrics

MOE = architecture_from_hf(tiny_moe_config())
DENSE = architecture_from_hf(tiny_moe_config() | {"model_type": "qwen3"})


def test_flags_parse_under_megatrons_names():
    args = ["--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "seq_aux_loss"]
    cfg = parse_args(args + ["--moe-z-loss-coeff", "1e-3"])
    assert (cfg.moe_aux_loss_coeff, cfg.moe_router_load_balancing_type, cfg.moe_z_loss_coeff) == (
        0.01,
        "seq_aux_loss",
        1e-3,
    )


def test_defaults_build_the_model_as_before():
    """Defaults: no router loss, Megatron's fields exactly what moe_settings gave without them."""
    cfg = load_config()
    assert {k: getattr(cfg, k) for k in ROUTER_LOSS_DEFAULTS} == ROUTER_LOSS_DEFAULTS
    assert moe_settings(MOE, 1, router_loss_settings(cfg)) == moe_settings(MOE, 1)
    assert moe_settings(MOE, 1)["moe_aux_loss_coeff"] == 0.0
    assert moe_settings(MOE, 1)["moe_router_load_balancing_type"] == "none"
    assert router_loss_metrics(cfg) == ()
    check_router_losses(DENSE, cfg)  # a dense model with the defaults is fine


def test_flags_reach_megatrons_moe_fields():
    cfg = load_config(overrides={"moe_aux_loss_coeff": 0.02, "moe_z_loss_coeff": 0.001})
    fields = moe_settings(MOE, 2, router_loss_settings(cfg))
    assert (fields["moe_router_load_balancing_type"], fields["moe_aux_loss_coeff"]) == ("aux_loss", 0.02)
    assert fields["moe_z_loss_coeff"] == 0.001
    assert router_loss_metrics(cfg) == ("moe_aux_loss", "moe_z_loss")
    assert moe_settings(DENSE, 2, router_loss_settings(cfg)) == {}


@pytest.mark.parametrize("bad", [["--moe-aux-loss-coeff", "-0.1"], ["--moe-router-load-balancing-type", "sinkhorn"]])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises((ConfigError, SystemExit)):
        parse_args(bad)


def test_a_coefficient_without_a_loss_type_is_refused_naming_both():
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=0.01 .*moe_router_load_balancing_type is none"):
        load_config(overrides={"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "none"})


@pytest.mark.parametrize(
    "overrides,flag",
    [
        ({"moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff=0.01"),
        ({"moe_router_load_balancing_type": "seq_aux_loss"}, "moe_router_load_balancing_type=seq_aux_loss"),
        ({"moe_z_loss_coeff": 0.001}, "moe_z_loss_coeff=0.001"),
    ],
)
def test_router_flags_on_a_dense_model_name_the_flag(overrides, flag):
    cfg = load_config(overrides=overrides)
    check_router_losses(MOE, cfg)
    with pytest.raises(ValueError, match=f"^{flag}: the model \\(model_type='qwen3'\\) has no experts") as err:
        check_router_losses(DENSE, cfg)
    assert "\n" not in str(err.value)
