"""bench/gpu/peer_trl.py without TRL: GRPOConfig's arguments derived from vime's bench YAMLs (one
generation batch per rollout, one optimizer step per rollout, the micro-batch within vime's token
budget), the refusals, the prompts cycled as vime's data cursor does, the sample the reward reads,
the step summary (median over the steps after the first) and the one line without CUDA."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
peer = load_bench("gpu/peer_trl.py", "peer_trl")

YAMLS = [REPO / "bench/gpu/colocated_0.5b.yaml", REPO / "bench/gpu/colocated_4b.yaml"]


def _cfg(path: Path, **overrides) -> dict:
    return peer.load_config(path, {"hf_checkpoint": "/nonexistent/model", **overrides}).model_dump()


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_settings_reproduce_the_vime_run(path):
    cfg = _cfg(path)
    s = peer.peer_settings(cfg)
    rollout = cfg["rollout_batch_size"] * cfg["n_samples_per_prompt"]
    micro = s["per_device_train_batch_size"]
    assert s["num_generations"] == cfg["n_samples_per_prompt"]
    # TRL: generation_batch_size = per_device x steps_per_generation; one optimizer step per
    # gradient_accumulation_steps micro-batches
    assert micro * s["steps_per_generation"] == rollout
    assert micro * s["gradient_accumulation_steps"] == cfg["global_batch_size"]
    assert s["steps_per_generation"] // s["gradient_accumulation_steps"] == cfg["num_steps_per_rollout"] == 1
    seq = cfg["rollout_max_prompt_len"] + cfg["rollout_max_response_len"]
    assert micro * seq <= cfg["max_tokens_per_gpu"]
    larger = [d for d in range(micro + 1, cfg["global_batch_size"] + 1) if cfg["global_batch_size"] % d == 0]
    assert not larger or larger[0] * seq > cfg["max_tokens_per_gpu"]
    assert s["max_completion_length"] == cfg["rollout_max_response_len"]
    assert s["vllm_max_model_length"] == seq
    assert s["learning_rate"] == cfg["lr"] and s["lr_scheduler_type"] == "constant"
    assert s["vllm_gpu_memory_utilization"] == cfg["vllm_gpu_memory_utilization"]
    assert not cfg["use_kl_loss"] and s["beta"] == 0.0
    assert s["entropy_coef"] == cfg["entropy_coef"]
    assert s["max_grad_norm"] == cfg["clip_grad"]
    assert s["bf16"] is True and s["gradient_checkpointing"] is False
    assert (s["use_vllm"], s["vllm_mode"], s["vllm_enable_sleep_mode"]) == (True, "colocate", True)
    # vime recomputes the old log-probs (use_rollout_logprobs off); TRL does for its correction
    assert s["vllm_importance_sampling_correction"] is not cfg["use_rollout_logprobs"]


def test_settings_follow_the_configuration():
    base = YAMLS[0]
    two = _cfg(base, num_steps_per_rollout=2)
    s = peer.peer_settings(two)
    assert s["steps_per_generation"] == 2 * s["gradient_accumulation_steps"]
    assert s["per_device_train_batch_size"] * s["gradient_accumulation_steps"] == two["global_batch_size"]

    kl = _cfg(base, use_kl_loss=True, kl_loss_coef=0.001)
    assert peer.peer_settings(kl)["beta"] == kl["kl_loss_coef"]

    fixed = _cfg(base, use_dynamic_batch_size=False, max_tokens_per_gpu=None, micro_batch_size=6)
    micro = peer.peer_settings(fixed)["per_device_train_batch_size"]
    assert micro <= fixed["micro_batch_size"] and fixed["global_batch_size"] % micro == 0
    assert all(fixed["global_batch_size"] % d for d in range(micro + 1, fixed["micro_batch_size"] + 1))

    other = _cfg(base, rollout_top_k=20, eps_clip_high=0.28, loss_agg_mode="seq_mean_token_sum_norm", lr_warmup_iters=3)
    s = peer.peer_settings(other)
    assert s["top_k"] == other["rollout_top_k"] and s["epsilon_high"] == other["eps_clip_high"]
    assert s["loss_type"] == "dr_grpo"
    assert (s["lr_scheduler_type"], s["warmup_steps"]) == ("constant_with_warmup", other["lr_warmup_iters"])
    assert peer.peer_settings(_cfg(base, grpo_std_normalization=False))["scale_rewards"] == "none"


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"advantage_estimator": "rloo"}, "advantage_estimator"),
        ({"loss_agg_mode": "seq_mean_token_sum"}, "loss_agg_mode"),
        ({"loss_agg_mode": "seq_mean_token_sum_norm", "loss_scale_factor": 100.0}, "loss_scale_factor"),
        ({"lr_decay_style": "cosine", "lr_decay_iters": 10}, "lr_decay_style"),
    ],
)
def test_settings_refuse_what_trl_cannot_reproduce(overrides, field):
    with pytest.raises(ValueError, match=field):
        peer.peer_settings(_cfg(YAMLS[0], **overrides))


def test_prompts_cycle_through_the_file():
    cfg = _cfg(YAMLS[0])
    s = peer.peer_settings(cfg)
    rows = [{"prompt": f"p{i}", "label": str(i)} for i in range(cfg["rollout_batch_size"] - 7)]
    steps = 3
    out = peer.prompts_for(rows, "prompt", steps, s, cfg["rollout_batch_size"])
    assert len(out) == steps * cfg["rollout_batch_size"]
    assert [r["prompt"] for r in out] == [rows[i % len(rows)]["prompt"] for i in range(len(out))]
    # two optimizer steps per rollout: half the rollouts
    two = peer.peer_settings(_cfg(YAMLS[0], num_steps_per_rollout=2))
    assert len(peer.prompts_for(rows, "prompt", 4, two, cfg["rollout_batch_size"])) == 2 * cfg["rollout_batch_size"]


class _CharTokenizer:
    special = {0}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if skip_special_tokens and i in self.special else chr(ord("a") + i) for i in ids)


def test_reward_reads_the_sample_as_vime_decodes_it():
    tok, eos = _CharTokenizer(), 0
    ids = [1, 2, 0, 3, eos]
    s = peer.vime_sample(tok, ids, eos, skip_special_tokens=False)
    assert s.response_length == len(ids)
    assert s.response == tok.decode(ids[:-1])  # the final EOS only
    truncated = peer.vime_sample(tok, ids[:-1], eos, skip_special_tokens=True)
    assert truncated.response == tok.decode(ids[:-1], skip_special_tokens=True)
    assert peer.alphabet_share(s) == len(s.response) / len(ids)


def test_summary_medians_the_steps_after_the_first():
    durations = [40.0, 10.0, 12.0, 11.0, 30.0]
    t0, start = 100.0, 163.0
    ticks, now = [], start
    for d in durations:
        ticks += [now, now + d]
        now += d + 0.5
    times = peer.StepTimes(clock=iter(ticks).__next__)
    tokens = [250_000 + i for i in range(len(durations))]
    for n in tokens:
        times.begin()
        times.add_tokens(n - 1)
        times.add_tokens(1)
        times.end()
    out = peer.summarize(times, t0)
    assert out["step_s"] == pytest.approx(durations)
    assert out["step_s_median"] == pytest.approx(statistics.median(durations[1:]))
    assert out["step_s_median"] != pytest.approx(statistics.median(durations))
    assert out["startup_s"] == pytest.approx(start - t0)
    assert out["completion_tokens_per_step"] == tokens

    one = peer.StepTimes(clock=itertools.count(start).__next__)
    one.begin()
    one.end()
    assert peer.summarize(one, t0)["step_s_median"] is None
    assert peer.summarize(peer.StepTimes(), t0)["startup_s"] is None


def test_without_cuda_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    argv = ["--model", str(tmp_path), "--prompts", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit, match="no CUDA device") as exc:
        peer.main([*argv, "--shape-config", str(YAMLS[0])])
    assert "\n" not in str(exc.value.code)
    assert not (tmp_path / "o.json").exists()
