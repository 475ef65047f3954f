"""Configuration: derived values (the run's layout and engine options), error messages, files, CLI, --help."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vime_core.config import (
    ConfigError,
    dp_size,
    engine_server_args,
    load_config,
    make_config,
    num_engines,
    parse_args,
    rollout_concurrency,
    weight_transport,
)

REPO = Path(__file__).resolve().parents[2]


def test_global_batch_size_from_steps():
    cfg = load_config(overrides={"rollout_batch_size": 32, "n_samples_per_prompt": 8, "num_steps_per_rollout": 1})
    assert cfg.global_batch_size == 32 * 8 // 1 == 256
    cfg4 = load_config(overrides={"rollout_batch_size": 32, "n_samples_per_prompt": 8, "num_steps_per_rollout": 4})
    assert cfg4.global_batch_size == 32 * 8 // 4 == 64


def test_steps_from_explicit_global_batch_size():
    cfg = load_config(
        overrides={
            "rollout_batch_size": 32,
            "n_samples_per_prompt": 8,
            "num_steps_per_rollout": None,
            "global_batch_size": 64,
        }
    )
    assert cfg.num_steps_per_rollout == 256 // 64


def test_inconsistent_global_batch_size_names_both_fields():
    with pytest.raises(ConfigError, match=r"global_batch_size=100 contradicts num_steps_per_rollout=1"):
        load_config(overrides={"rollout_batch_size": 32, "n_samples_per_prompt": 8, "global_batch_size": 100})


def test_eps_clip_high_and_over_sampling_defaults():
    cfg = load_config(overrides={"eps_clip": 0.2, "rollout_batch_size": 32})
    assert cfg.eps_clip_high == cfg.eps_clip == 0.2
    assert cfg.over_sampling_batch_size == cfg.rollout_batch_size == 32
    explicit = load_config(overrides={"eps_clip": 0.2, "eps_clip_high": 0.28, "over_sampling_batch_size": 48})
    assert (explicit.eps_clip_high, explicit.over_sampling_batch_size) == (0.28, 48)


def _reference_placement(**over):
    values = {
        "actor_num_gpus_per_node": 8,
        "tensor_model_parallel_size": 2,
        "rollout_num_gpus": 8,
        "rollout_num_gpus_per_engine": 2,
        "vllm_server_concurrency": 512,
        "device": "cuda",
    }
    values.update(over)
    return load_config(overrides=values)


def test_engines_concurrency_and_dp():
    cfg = _reference_placement()
    assert num_engines(cfg) == 8 // 2 == 4
    assert rollout_concurrency(cfg) == 512 * num_engines(cfg) == 2048
    assert dp_size(cfg) == 8 // 2 == 4


def test_engine_server_args():
    cfg = _reference_placement(offload_rollout=True, rollout_max_context_len=4096)
    args = engine_server_args(cfg)
    assert args["enable_sleep_mode"] is True
    assert args["max_model_len"] == 4096
    assert weight_transport(cfg) == "ipc" and args["weight_transfer_config"] == {"backend": "ipc"}
    assert engine_server_args(_reference_placement(offload_rollout=False))["enable_sleep_mode"] is False
    assert weight_transport(load_config(overrides={"device": "cpu"})) == "shm"
    derived = load_config(overrides={"rollout_max_prompt_len": 100, "rollout_max_response_len": 28})
    assert engine_server_args(derived)["max_model_len"] == 100 + 28


@pytest.mark.parametrize(
    "over, field",
    [
        ({"tensor_model_parallel_size": 3, "actor_num_gpus_per_node": 8}, "tensor_model_parallel_size"),
        ({"rollout_num_gpus_per_engine": 3, "rollout_num_gpus": 8, "colocate": False}, "rollout_num_gpus_per_engine"),
        ({"num_steps_per_rollout": 3}, "num_steps_per_rollout"),
        ({"eps_clip_c": 0.5}, "eps_clip_c"),
        ({"rollout_batch_size": "abc"}, "rollout_batch_size"),
        ({"advantage_estimator": "dpo"}, "advantage_estimator"),
        ({"use_dynamic_batch_size": True}, "max_tokens_per_gpu"),
        ({"rm_type": "remote_rm"}, "rm_url"),
        ({"rm_type": "maths"}, r"rm_type='maths' is unknown; known: arith, exact_match, f1, math, remote_rm"),
    ],
)
def test_bad_values_name_the_field(over, field):
    with pytest.raises(ConfigError, match=field):
        load_config(overrides=over)


def test_an_unknown_rm_type_passes_with_the_users_own_reward():
    cfg = load_config(overrides={"rm_type": "maths", "custom_rm_path": "vime_core.demo.task:reward"})
    assert cfg.custom_rm_path == "vime_core.demo.task:reward"  # custom_rm_path overrides rm_type


def test_what_each_estimator_reads_passes():
    """The settings the refusals above name pass where they are read."""
    load_config(overrides={"advantage_estimator": "reinforce_plus_plus", "gamma": 0.9, "kl_coef": 0.1})
    load_config(overrides={"advantage_estimator": "ppo", "gamma": 0.99, "lambd": 0.95})
    load_config(overrides={"advantage_estimator": "grpo", "grpo_std_normalization": False})
    load_config(overrides={"advantage_estimator": "cispo", "eps_clip": 0.3})  # cispo's upper clip without eps_clip_high
    load_config(overrides={"loss_type": "sft_loss", "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01})


def test_the_critic_only_rollouts_leave_the_policys_schedule_out():
    """The policy's schedule decays over its own optimizer steps; the critic's over those and its
    critic-only steps, so that both end at the last rollout."""
    from vime_core.trainer.critic import critic_config

    cfg = load_config(
        overrides={
            "advantage_estimator": "ppo",
            "num_rollout": 10,
            "num_critic_only_steps": 4,
            "num_steps_per_rollout": 2,
        }
    )
    assert cfg.lr_decay_iters == (10 - 4) * 2
    assert critic_config(cfg).lr_decay_iters == 10 * 2


def test_unknown_field_rejected():
    with pytest.raises(ConfigError, match="rollout_batch_sise"):
        load_config(overrides={"rollout_batch_sise": 4})


def test_yaml_file_with_cli_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout-batch-size: 16\nn_samples_per_prompt: 4\nadvantage_estimator: gspo\n")
    cfg = parse_args(["--config", str(path), "--rollout-batch-size", "8", "--no-colocate"])
    assert cfg.rollout_batch_size == 8  # the flag wins over the file
    assert cfg.n_samples_per_prompt == 4 and cfg.advantage_estimator == "gspo" and cfg.colocate is False
    assert cfg.global_batch_size == 8 * 4


def test_a_list_flag_given_again_adds_its_values(tmp_path):
    """vLLM's own flags start with `--`, so each goes as `--vllm-extra-args=--flag=value`; several
    such flags add up, and a list flag replaces the file's list."""
    path = tmp_path / "run.yaml"
    path.write_text("vllm_extra_args: [--max-num-seqs=8]\n")
    cfg = parse_args(
        ["--config", str(path), "--vllm-extra-args=--kv-cache-memory=8000000000", "--vllm-extra-args=--max-num-seqs=48"]
    )
    assert cfg.vllm_extra_args == ["--kv-cache-memory=8000000000", "--max-num-seqs=48"]
    assert parse_args(["--config", str(path)]).vllm_extra_args == ["--max-num-seqs=8"]
    assert parse_args(["--vllm-env", "A=1", "B=2", "--vllm-env", "C=3"]).vllm_env == ["A=1", "B=2", "C=3"]


@pytest.mark.parametrize(
    "flags, colocate",
    [
        (["--colocate"], True),
        (["--no-colocate"], False),
        (["--colocate", "false"], False),
        (["--colocate", "true"], True),
        (["--colocate", "0", "--seed", "3"], False),
    ],
)
def test_boolean_flags_take_a_value_or_none(flags, colocate):
    assert parse_args(flags).colocate is colocate


def test_boolean_flags_refuse_what_is_not_a_boolean(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--colocate", "maybe"])
    assert "colocate: Input should be a valid boolean" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--no-colocate", "false"])
    assert "--no-colocate takes no value" in capsys.readouterr().err


def test_json_file_and_bad_files(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"seed": 7}))
    assert load_config(path).seed == 7
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="bad.yaml must hold a mapping"):
        load_config(bad)


def test_cli_error_names_field_and_exits(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--rollout-batch-size", "zero"])
    assert "rollout_batch_size" in capsys.readouterr().err


def _timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=30)
    return time.perf_counter() - start, proc


@pytest.mark.integration  # a fresh interpreter
def test_help_is_instant():
    code = "from vime_core.config import parse_args; parse_args(['--help'])"
    elapsed, proc = _timed([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "--rollout-batch-size" in proc.stdout and "--eps-clip-high" in proc.stdout
    assert elapsed < 2.0, f"config --help took {elapsed:.2f}s"


@pytest.mark.integration  # a fresh interpreter
def test_vime_train_help_is_instant():
    script = Path(sys.executable).parent / "vime"
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . creates it)")
    elapsed, proc = _timed([str(script), "train", "--help"])
    assert proc.returncode == 0, proc.stderr
    assert "--rollout-batch-size" in proc.stdout
    assert elapsed < 2.0, f"vime train --help took {elapsed:.2f}s"


def test_an_abbreviated_flag_is_refused_not_taken_for_another_field(capsys):
    """argparse would take `--clip` for the one flag it begins (clip_grad) and `--max-tokens` for
    max_tokens_per_gpu: a user meaning eps_clip would train with the gradient clip changed."""
    for abbreviated in (["--clip", "0.28"], ["--max-tokens", "4096"]):
        with pytest.raises(SystemExit):
            parse_args(abbreviated)
        assert f"unrecognized arguments: {' '.join(abbreviated)}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "values, says",
    [
        ({"max_tokens_per_gpu": 4096}, "max_tokens_per_gpu=4096 has no effect without use_dynamic_batch_size=true"),
        ({"tis_clip": 3.0}, "tis_clip=3.0 has no effect without use_tis=true"),
        ({"eps_clip": 1.0}, "eps_clip=1.0: the lower ratio bound 1 - eps_clip is <= 0"),
        ({"num_rollout": 5, "start_rollout_id": 5}, "start_rollout_id=5 is at or past num_rollout=5"),
        ({"rollout_stop": ["</answer>", ""]}, "rollout_stop[1] is empty"),
        ({"prompt_data": "data/math.jsonl", "eval_interval": 10}, "eval_interval=10 needs eval_prompt_data"),
        ({"device": "cuda", "engine_urls": ["http://10.0.0.5:8000"]}, "engine_urls with colocate=true"),
        ({"storage_uri": ""}, "storage_uri is empty"),
        ({"storage_uri": "S3://bucket/runs"}, "storage_uri: write its scheme 'S3' in lower case"),
        ({"storage_uri": "s3:/bucket/runs"}, "storage_uri begins 's3:/', one slash after the scheme"),
        ({"vllm_extra_args": ["--max-num-seqs=8", "--dtype=float16"]}, "vllm_extra_args[1] sets --dtype, which vime"),
        ({"vllm_extra_args": ["--logprobs-mode", "raw_logprobs"]}, "sets --logprobs-mode, which vime sets for every"),
        ({"vllm_extra_args": [""]}, "vllm_extra_args[0] is empty"),
        (
            {"custom_rm_path": "my_rewards.fixed"},
            "custom_rm_path='my_rewards.fixed': expected 'package.module:function'",
        ),
        ({"dynamic_sampling_filter_path": "a:b:c"}, "dynamic_sampling_filter_path='a:b:c': expected"),
        ({"lora_rank": 8, "moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff is for mixture-of-experts models"),
        ({"lora_rank": 8, "use_rollout_routing_replay": True}, "use_rollout_routing_replay is for mixture-of-experts"),
        # what sft_loss (minus the log-probability of the response) never reads
        ({"loss_type": "sft_loss", "use_tis": True}, "use_tis=True has no effect without loss_type=policy_loss"),
        ({"loss_type": "sft_loss", "eps_clip_c": 3.0}, "eps_clip_c=3.0 has no effect without loss_type=policy_loss"),
        (
            {"loss_type": "sft_loss", "advantage_estimator": "reinforce_plus_plus", "kl_coef": 0.1},
            "kl_coef=0.1 has no effect without loss_type=policy_loss",
        ),
        (
            {"loss_type": "sft_loss", "use_rollout_logprobs": True},
            "use_rollout_logprobs=True has no effect without loss_type=policy_loss",
        ),
        # what the estimator never reads
        ({"gamma": 0.9}, "gamma=0.9 has no effect without token rewards: ppo, reinforce_plus_plus"),
        ({"advantage_estimator": "rloo", "lambd": 0.95}, "lambd=0.95 has no effect without GAE: ppo"),
        (
            {"advantage_estimator": "rloo", "grpo_std_normalization": False},
            "grpo_std_normalization=False has no effect without a group std normalisation: cispo, grpo, gspo",
        ),
        ({"advantage_estimator": "cispo", "eps_clip_c": 3.0}, "eps_clip_c=3.0 has no effect without a dual clip"),
        (
            {"advantage_estimator": "cispo", "eps_clip_high": 0.3, "eps_clip": 0.1},
            "eps_clip=0.1 has no effect without a lower clip, which the cispo loss has not",
        ),
        ({"num_rollout": 3, "advantage_estimator": "ppo", "num_critic_only_steps": 3}, "leaves the policy no rollout"),
    ],
)
def test_a_setting_that_would_do_nothing_or_fail_late_is_refused(values, says):
    """Each would run and do nothing (the micro-batch bound, the clip, the iterations), or fail only
    after the engines started (vLLM's refusal of an empty stop string), or write elsewhere than
    meant (a local folder `s3:`, the filesystem's root)."""
    with pytest.raises(ConfigError) as err:
        make_config(values)
    assert says in str(err.value)


def test_a_refused_credential_location_is_not_echoed():
    """A user who gives the token itself where its variable's name goes (rm_api_key_env) does not
    find it printed in the error; other refused values are shown."""
    with pytest.raises(ConfigError) as err:
        make_config({"rm_api_key_env": "sk-live-canary-123"})
    assert "sk-live-canary-123" not in str(err.value) and "rm_api_key_env" in str(err.value)
    with pytest.raises(ConfigError, match=r"rollout_batch_size: .*\(got -1\)"):
        make_config({"rollout_batch_size": -1})


@pytest.mark.parametrize(
    "name, text, says",
    [
        (
            "dup.yaml",
            "rollout_batch_size: 4\nseed: 1\nrollout_batch_size: 8\n",
            "key 'rollout_batch_size' is given twice",
        ),
        ("dup.json", '{"seed": 1, "seed": 2}', "key 'seed' is given twice"),
        ("spellings.yaml", "rollout_batch_size: 4\nrollout-batch-size: 8\n", "gives rollout_batch_size twice"),
    ],
)
def test_a_field_given_twice_in_a_file_is_refused(tmp_path, name, text, says):
    """YAML and JSON keep the last of two equal keys without a word: one of the two values the
    user wrote would be dropped."""
    (tmp_path / name).write_text(text)
    with pytest.raises(ConfigError, match=f"config file .*{name}.*{says}"):
        load_config(tmp_path / name)
