"""Optimizer, schedule and recompute configuration: slime's flag names, derived defaults, the
checks that name the fields, and what reaches Megatron's TransformerConfig / OptimizerConfig /
DDP config."""

from __future__ import annotations

import pytest
import torch

from vime_core.config import ConfigError, VimeConfig, make_config, parse_args
from vime_core.config.loader import build_parser

SLIME_FLAGS = [
    "--lr",
    "--lr-decay-style",
    "--lr-decay-iters",
    "--lr-warmup-iters",
    "--lr-warmup-fraction",
    "--lr-warmup-init",
    "--min-lr",
    "--weight-decay",
    "--adam-beta1",
    "--adam-beta2",
    "--adam-eps",
    "--clip-grad",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--use-distributed-optimizer",
]


def test_flags_are_slimes():
    options = {s for action in build_parser()._actions for s in action.option_strings}
    assert set(SLIME_FLAGS) <= options
    assert "--no-use-distributed-optimizer" in options


def test_a_slime_optimizer_block_parses():
    cfg = parse_args(
        [
            "--num-rollout",
            "100",
            "--lr",
            "1e-6",
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-iters",
            "10",
            "--min-lr",
            "1e-7",
            "--weight-decay",
            "0.1",
            "--adam-beta1",
            "0.9",
            "--adam-beta2",
            "0.95",
            "--adam-eps",
            "1e-6",
            "--clip-grad",
            "0.5",
        ]
    )
    assert (cfg.lr, cfg.lr_decay_style, cfg.lr_warmup_iters, cfg.min_lr) == (1e-6, "cosine", 10, 1e-7)
    assert (cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.clip_grad) == (
        0.1,
        0.9,
        0.95,
        1e-6,
        0.5,
    )
    assert cfg.lr_decay_iters == 100  # the run's optimizer steps


def test_gpu_flags_parse_for_cuda():
    cfg = parse_args(["--device", "cuda", "--recompute-granularity", "full", "--use-distributed-optimizer"])
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)
    assert cfg.use_distributed_optimizer is True
    cfg = parse_args(
        [
            "--device",
            "cuda",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            "2",
        ]
    )
    assert (cfg.recompute_method, cfg.recompute_num_layers) == ("block", 2)
    assert parse_args(["--device", "cuda", "--recompute-granularity", "selective"]).recompute_method is None


def test_defaults_keep_the_default_job_unchanged():
    cfg = VimeConfig()
    assert (cfg.lr_decay_style, cfg.lr_warmup_iters, cfg.lr_warmup_fraction, cfg.lr_warmup_init, cfg.min_lr) == (
        "constant",
        0,
        None,
        0.0,
        0.0,
    )
    assert (cfg.weight_decay, cfg.adam_beta1, cfg.adam_beta2, cfg.adam_eps, cfg.clip_grad) == (
        0.0,
        0.9,
        0.98,
        1e-8,
        1.0,
    )
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == (None, None, None)
    assert cfg.use_distributed_optimizer is False
    assert cfg.lr_decay_iters == cfg.num_rollout * cfg.num_steps_per_rollout


def test_reloading_a_resolved_config_gives_the_same_config():
    cfg = make_config({"device": "cuda", "recompute_granularity": "full", "lr_warmup_fraction": 0.1})
    assert make_config(cfg.model_dump()) == cfg


@pytest.mark.parametrize(
    "values, message",
    [
        (
            {"lr_warmup_iters": 5, "lr_warmup_fraction": 0.1},
            "lr_warmup_iters=5 and lr_warmup_fraction=0.1 are both set",
        ),
        ({"lr": 1e-4, "min_lr": 1e-3}, "min_lr=0.001 is above lr=0.0001"),
        ({"lr": 1e-4, "lr_warmup_init": 1e-3}, "lr_warmup_init=0.001 is above lr=0.0001"),
        (
            {"num_rollout": 10, "lr_warmup_iters": 11, "lr_decay_iters": 100},
            r"lr_warmup_iters gives 11 warmup steps, more than the policy's 10 optimizer steps \(\(num_rollout=10",
        ),
        (
            {"num_rollout": 10, "lr_warmup_iters": 10},
            "lr_warmup_iters gives 10 warmup steps, not fewer than lr_decay_iters=10",
        ),
        ({"num_rollout": 10, "lr_warmup_iters": 4, "lr_decay_iters": 3}, "not fewer than lr_decay_iters=3"),
        ({"lr_warmup_fraction": 1.0}, "lr_warmup_fraction gives 60 warmup steps, not fewer than lr_decay_iters=60"),
        ({"lr_decay_iters": 0}, "lr_decay_iters: Input should be greater than or equal to 1"),
        ({"lr_decay_style": "WSD"}, "lr_decay_style: Input should be 'constant', 'linear' or 'cosine'"),
        ({"recompute_granularity": "full"}, "recompute_granularity=full needs device=cuda"),
        ({"recompute_granularity": "selective"}, "recompute_granularity=selective needs device=cuda"),
        ({"use_distributed_optimizer": True}, "use_distributed_optimizer=True needs device=cuda"),
        (
            {"device": "cuda", "recompute_method": "uniform"},
            "recompute_method=uniform needs recompute_granularity=full",
        ),
        (
            {"device": "cuda", "recompute_granularity": "selective", "recompute_num_layers": 2},
            "recompute_num_layers=2 needs recompute_granularity=full",
        ),
    ],
)
def test_bad_settings_name_the_field(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_bad_flag_ends_the_cli_naming_the_field(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--use-distributed-optimizer"])
    assert exc.value.code == 2
    assert "use_distributed_optimizer=True needs device=cuda" in capsys.readouterr().err


def test_settings_reach_megatrons_configs():
    """Building Megatron's config objects needs no GPU: the fields arrive as named."""
    from vime_core.trainer.model import HFArchitecture, recompute_settings, transformer_config
    from vime_core.trainer.optimizer import ddp_config, optimizer_config

    cfg = make_config(
        {
            "device": "cuda",
            "recompute_granularity": "full",
            "recompute_method": "block",
            "recompute_num_layers": 2,
            "use_distributed_optimizer": True,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "adam_eps": 1e-6,
            "min_lr": 1e-5,
            "clip_grad": 0.5,
        }
    )
    arch = HFArchitecture(
        model_type="qwen3",
        vocab_size=32,
        hidden_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        ffn_hidden_size=32,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling_factor=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=False,
        qk_norm=True,
    )
    tc = transformer_config(arch, 1, torch.float32, recompute_settings(cfg))
    assert (tc.recompute_granularity, tc.recompute_method, tc.recompute_num_layers) == ("full", "block", 2)
    assert transformer_config(arch, 1, torch.float32, recompute_settings(VimeConfig())).recompute_granularity is None
    oc = optimizer_config(cfg, torch.bfloat16)
    assert (
        oc.optimizer,
        oc.lr,
        oc.min_lr,
        oc.weight_decay,
        oc.adam_beta1,
        oc.adam_beta2,
        oc.adam_eps,
        oc.clip_grad,
    ) == ("adam", cfg.lr, 1e-5, 0.1, 0.9, 0.95, 1e-6, 0.5)
    assert oc.use_distributed_optimizer is True and oc.bf16 is True
    assert ddp_config(cfg).use_distributed_optimizer is True
    assert ddp_config(VimeConfig()).use_distributed_optimizer is False
