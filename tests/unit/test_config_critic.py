"""The critic's settings (advantage_estimator=ppo): accepted with a critic, critic_lr derived from
lr, and every one of them refused without a critic or in a schedule Megatron would refuse, when
the configuration is made, with one line naming the field."""

from __future__ import annotations

import pytest

from vime_core.config import ConfigError, load_config, parse_args


def test_ppo_is_accepted_and_critic_lr_defaults_to_lr():
    cfg = load_config(overrides={"advantage_estimator": "ppo", "lr": 3e-6})
    assert cfg.critic_lr == 3e-6 and cfg.value_clip == 0.2 and cfg.num_critic_only_steps == 0
    own = load_config(overrides={"advantage_estimator": "ppo", "critic_lr": 1e-5, "num_critic_only_steps": 2})
    assert own.critic_lr == 1e-5 and own.num_critic_only_steps == 2


@pytest.mark.parametrize("field", ["critic_load", "critic_save"])
def test_critic_paths_are_made_absolute_and_uris_kept(tmp_path, monkeypatch, field):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides={"advantage_estimator": "ppo", field: "critic-dir"})
    assert getattr(cfg, field) == str(tmp_path / "critic-dir")
    uri = load_config(overrides={"advantage_estimator": "ppo", field: "s3://bucket/critic"})
    assert getattr(uri, field) == "s3://bucket/critic"


@pytest.mark.parametrize(
    "field, value",
    [
        ("critic_lr", 1e-5),
        ("critic_load", "/models/critic"),
        ("critic_save", "/ckpt/critic"),
        ("critic_lr_warmup_iters", 3),
        ("num_critic_only_steps", 1),
        ("value_clip", 0.5),
    ],
)
def test_critic_settings_without_a_critic_are_refused(field, value):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={field: value})
    # one line under the configuration's header
    assert str(err.value).splitlines()[1:] == [
        f"  {field}={value} has no effect without a critic (advantage_estimator=ppo; it is grpo)"
    ]


def test_the_cli_names_the_flag_of_a_critic_setting_without_ppo(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--critic-lr", "1e-5"])
    assert "critic_lr=1e-05 has no effect without a critic" in capsys.readouterr().err
    assert parse_args(["--advantage-estimator", "ppo", "--critic-lr", "1e-5"]).critic_lr == 1e-5
    with pytest.raises(SystemExit):
        parse_args(["--critic-save", "s3://bucket/critic", "--advantage-estimator", "reinforce_plus_plus"])
    assert (
        "critic_save=s3://bucket/critic has no effect without a critic (advantage_estimator=ppo; "
        "it is reinforce_plus_plus)"
    ) in capsys.readouterr().err
    assert parse_args(["--advantage-estimator", "ppo", "--critic-save", "s3://b/c"]).critic_save == "s3://b/c"


@pytest.mark.parametrize(
    "over, message",
    [
        ({"critic_lr": 1e-7, "lr": 1e-6, "min_lr": 1e-6}, r"critic_lr=1e-07 is below min_lr=1e-06"),
        ({"critic_lr": 1e-7, "lr": 1e-6, "lr_warmup_init": 5e-7}, r"critic_lr=1e-07 is below lr_warmup_init=5e-07"),
        (
            {"critic_lr_warmup_iters": 60, "num_rollout": 60},
            r"critic_lr_warmup_iters=60 is not fewer than the critic's decay steps 60 \(lr_decay_iters=60",
        ),
        ({"loss_type": "sft_loss"}, r"loss_type=sft_loss has no advantages"),
    ],
)
def test_a_critic_schedule_megatron_would_refuse_is_refused_first(over, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"advantage_estimator": "ppo", **over})
