"""TRL's GRPOTrainer, the peer a user would pick instead of vime (issue 43), on vime's colocated
bench shape: the same model folder, prompts file and dense reward (bench/gpu/rewards.py), with the
batch, lengths, learning rate and vLLM memory fraction read from vime's YAML (--shape-config), so
the two cannot drift. vLLM runs inside the trainer's process (TRL's colocate mode) and sleeps while
the trainer steps. One JSON: each optimizer step's wall seconds (a TrainerCallback, the device
synchronised at on_step_begin and on_step_end), their median over the steps after the first, the
seconds from the command to the first step, and the completion tokens each step generated.

GRPOConfig from vime's configuration (peer_settings):
- one generation batch per rollout: rollout_batch_size prompts x num_generations (n_samples_per_prompt);
  per_device_train_batch_size x gradient_accumulation_steps = global_batch_size (samples per optimizer
  step) and steps_per_generation = gradient_accumulation_steps x num_steps_per_rollout, so one
  optimizer step per generation batch when num_steps_per_rollout is 1.
- per_device_train_batch_size: the largest divisor of global_batch_size whose micro-batch of
  sequences padded to rollout_max_prompt_len + rollout_max_response_len tokens (TRL pads each
  micro-batch to its longest; vime packs by tokens) fits max_tokens_per_gpu (use_dynamic_batch_size),
  else micro_batch_size. TRL's old-log-prob pass uses the same chunks.
- max_completion_length = rollout_max_response_len; vllm_max_model_length = rollout_max_context_len.
  TRL does not truncate prompts: the file's prompts are already rollout_max_prompt_len tokens.
- temperature, top_p, top_k = rollout_* (vime's top_k -1 is TRL's 0: off).
- learning_rate = lr, constant schedule (TRL's default decays linearly to 0 over max_steps) after
  lr_warmup_iters; adam_beta1/2, adam_epsilon, weight_decay, max_grad_norm = clip_grad.
- beta = kl_loss_coef under use_kl_loss, else 0: no reference model is loaded.
- epsilon/epsilon_high = eps_clip/eps_clip_high; loss_type from loss_agg_mode (token_mean: dapo,
  normalised by the tokens of the accumulated batch; seq_mean_token_mean: grpo;
  seq_mean_token_sum_norm: dr_grpo, whose constant is max_completion_length); scale_rewards
  group/none from grpo_std_normalization; entropy_coef.
- vllm_importance_sampling_correction = not use_rollout_logprobs: with generation and optimizer
  steps aligned, TRL recomputes the old log-probs with the trainer only for that correction; vime
  recomputes them unless use_rollout_logprobs.
- bf16 autocast over TRL's default float32 weights and Adam states (Megatron's bf16 keeps fp32 main
  parameters too).
- gradient_checkpointing off (TRL's default is on); --gradient-checkpointing turns it on.
- use_vllm, vllm_mode colocate, vllm_enable_sleep_mode (level 2 after each generation; weights, then
  KV cache woken before the next), vllm_gpu_memory_utilization = vime's. TRL itself sets the
  engine's max_num_seqs to the generation batch and max_num_batched_tokens to 4096.
- seed = vime's seed; a log line every step, no checkpoints, no trackers.

    PYTHONPATH=/tmp/site-peer:/tmp/site-vllm:/tmp/site-trainer:$PWD python3 bench/gpu/peer_trl.py \\
        --model /tmp/vime-gpu/model-0.5b --prompts /tmp/vime-gpu/prompts-512.jsonl --steps 8 \\
        --shape-config bench/gpu/colocated_0.5b.yaml --out /tmp/vime-out/peer_trl.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Mapping

T_START = time.time()  # this process's start, the default --t0

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.gpu.rewards import alphabet_share  # noqa: E402
from vime_core.config.loader import load_config  # noqa: E402

# vime's loss_agg_mode -> TRL's loss_type with the same normalisation of the token losses
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "seq_mean_token_sum_norm": "dr_grpo"}


def micro_batch(cfg: Mapping[str, Any]) -> int:
    """The largest divisor of global_batch_size within the trainer's micro-batch limit: the token
    budget over the longest sequence (use_dynamic_batch_size), else micro_batch_size; at least 1."""
    per_step = cfg["global_batch_size"]
    seq = cfg["rollout_max_prompt_len"] + cfg["rollout_max_response_len"]
    if cfg["use_dynamic_batch_size"] and cfg["max_tokens_per_gpu"]:
        limit = cfg["max_tokens_per_gpu"] // seq
    else:
        limit = cfg["micro_batch_size"]
    return max(d for d in range(1, max(1, min(per_step, limit)) + 1) if per_step % d == 0)


def peer_settings(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GRPOConfig's keyword arguments for vime's configuration `cfg` (a VimeConfig's model_dump),
    as the module's docstring lists them; ValueError naming the field vime sets that TRL cannot
    reproduce."""
    if cfg["advantage_estimator"] != "grpo" or cfg["loss_type"] != "policy_loss":
        raise ValueError(
            f"advantage_estimator={cfg['advantage_estimator']}, loss_type={cfg['loss_type']}: "
            "the peer runs GRPO's policy loss only"
        )
    if cfg["loss_agg_mode"] not in LOSS_TYPES:
        raise ValueError(f"loss_agg_mode={cfg['loss_agg_mode']}: TRL has none of that; one of {sorted(LOSS_TYPES)}")
    scale = cfg["loss_scale_factor"]
    if cfg["loss_agg_mode"] == "seq_mean_token_sum_norm" and scale not in (None, cfg["rollout_max_response_len"]):
        raise ValueError(f"loss_scale_factor={scale}: TRL's dr_grpo divides by max_completion_length")
    if cfg["lr_decay_style"] != "constant":
        raise ValueError(f"lr_decay_style={cfg['lr_decay_style']}: the peer reproduces the constant schedule only")
    per_step = cfg["global_batch_size"]
    rollout = cfg["rollout_batch_size"] * cfg["n_samples_per_prompt"]
    if rollout % per_step:
        raise ValueError(f"global_batch_size={per_step} does not divide the rollout's {rollout} samples")
    micro = micro_batch(cfg)
    accumulation = per_step // micro
    return {
        "num_generations": cfg["n_samples_per_prompt"],
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": accumulation * (rollout // per_step),
        "max_completion_length": cfg["rollout_max_response_len"],
        "vllm_max_model_length": cfg["rollout_max_context_len"],
        "temperature": cfg["rollout_temperature"],
        "top_p": cfg["rollout_top_p"],
        "top_k": max(0, cfg["rollout_top_k"]),
        "learning_rate": cfg["lr"],
        "lr_scheduler_type": "constant_with_warmup" if cfg["lr_warmup_iters"] else "constant",
        "warmup_steps": cfg["lr_warmup_iters"],
        "adam_beta1": cfg["adam_beta1"],
        "adam_beta2": cfg["adam_beta2"],
        "adam_epsilon": cfg["adam_eps"],
        "weight_decay": cfg["weight_decay"],
        "max_grad_norm": cfg["clip_grad"],
        "beta": cfg["kl_loss_coef"] if cfg["use_kl_loss"] else 0.0,
        "epsilon": cfg["eps_clip"],
        "epsilon_high": cfg["eps_clip_high"] if cfg["eps_clip_high"] is not None else cfg["eps_clip"],
        "loss_type": LOSS_TYPES[cfg["loss_agg_mode"]],
        "scale_rewards": "group" if cfg["grpo_std_normalization"] else "none",
        "entropy_coef": cfg["entropy_coef"],
        "vllm_importance_sampling_correction": not cfg["use_rollout_logprobs"],
        "bf16": bool(cfg["bf16"]),
        "gradient_checkpointing": False,
        "use_vllm": True,
        "vllm_mode": "colocate",
        "vllm_enable_sleep_mode": True,
        "vllm_gpu_memory_utilization": cfg["vllm_gpu_memory_utilization"],
        "seed": cfg["seed"],
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
    }


def prompts_for(rows: list[dict], key: str, steps: int, settings: Mapping[str, Any], prompts_per_rollout: int) -> list:
    """The file's prompts in order, repeated as vime's data cursor goes round its epochs, enough
    for `steps` optimizer steps: TRL keeps only whole generation batches of distinct indices."""
    rollouts = math.ceil(steps * settings["gradient_accumulation_steps"] / settings["steps_per_generation"])
    need = rollouts * prompts_per_rollout
    return [{"prompt": rows[i % len(rows)][key]} for i in range(need)]


def vime_sample(tokenizer: Any, ids: list[int], eos_token_id: int | None, skip_special_tokens: bool):
    """What vime's reward functions read of a sample: the response text without a final EOS
    (vime_core/rollout/generate.py decode_response) and the response's token count."""
    text_ids = ids[:-1] if ids and eos_token_id is not None and ids[-1] == eos_token_id else ids
    return SimpleNamespace(
        response=tokenizer.decode(text_ids, skip_special_tokens=skip_special_tokens), response_length=len(ids)
    )


class StepTimes:
    """Each optimizer step's wall seconds (begin() to end()) and the completion tokens generated
    since the previous step ended (add_tokens), on `clock`."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.first_begin: float | None = None
        self.step_s: list[float] = []
        self.tokens: list[int] = []
        self._begin: float | None = None
        self._pending_tokens = 0

    def begin(self) -> None:
        self._begin = self.clock()
        if self.first_begin is None:
            self.first_begin = self._begin

    def end(self) -> None:
        self.step_s.append(self.clock() - self._begin)
        self.tokens.append(self._pending_tokens)
        self._pending_tokens = 0

    def add_tokens(self, n: int) -> None:
        self._pending_tokens += n


def summarize(times: StepTimes, t0: float) -> dict[str, Any]:
    """step_s, their median over the steps after the first (None with fewer than two: the first
    pays for compilation and warm-up), startup_s = first step's begin - t0, tokens per step."""
    return {
        "step_s": times.step_s,
        "step_s_median": statistics.median(times.step_s[1:]) if len(times.step_s) > 1 else None,
        "startup_s": times.first_begin - t0 if times.first_begin is not None else None,
        "completion_tokens_per_step": times.tokens,
    }


def read_rows(path: str) -> list[dict]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"--prompts {path}: no rows")
    return rows


def train(a: argparse.Namespace, cfg: Mapping[str, Any], settings: dict[str, Any], times: StepTimes) -> dict:
    """Builds TRL's trainer on the model folder and prompts, trains a.steps optimizer steps and
    returns the versions, the settings TRL derived and the error line if training stopped."""
    # boundary: torch, TRL, datasets and vLLM exist on the GPU host's path only (/tmp/site-peer,
    # /tmp/site-vllm); --help and the unit tests import none of them
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("peer_trl.py: no CUDA device: TRL's colocated vLLM needs a GPU")
    try:
        # boundary: as above, after the device check
        import datasets
        import transformers
        import trl
        import vllm
    except ImportError as exc:
        raise SystemExit(
            f"peer_trl.py: cannot import {exc.name}: PYTHONPATH needs /tmp/site-peer (bench/gpu/peer_wheels.sh) "
            "and /tmp/site-vllm before the repository"
        ) from None

    tokenizer = transformers.AutoTokenizer.from_pretrained(a.model)
    eos, skip = tokenizer.eos_token_id, cfg["rollout_skip_special_tokens"]

    def alphabet_share_reward(prompts, completions, completion_ids, **_):
        times.add_tokens(sum(len(ids) for ids in completion_ids))
        return [alphabet_share(vime_sample(tokenizer, list(ids), eos, skip)) for ids in completion_ids]

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.begin()

        def on_step_end(self, args, state, control, **kwargs):
            torch.cuda.synchronize()
            times.end()

    rows = prompts_for(read_rows(a.prompts), cfg["input_key"], a.steps, settings, cfg["rollout_batch_size"])
    config = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="peer-trl-"), max_steps=a.steps, **settings)
    error = None
    try:
        trl.GRPOTrainer(
            model=a.model,
            reward_funcs=alphabet_share_reward,
            args=config,
            train_dataset=datasets.Dataset.from_list(rows),
            callbacks=[Timer()],
        ).train()
    except Exception as exc:  # a start or step that fails (out of memory): what was measured still goes to --out
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {
        "trl_version": trl.__version__,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "derived": {
            "generation_batch_size": config.generation_batch_size,
            "steps_per_generation": config.steps_per_generation,
        },
        "error": error,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the model folder (bench/gpu/build_model.py --out)")
    p.add_argument("--prompts", required=True, help="the prompts jsonl (bench/gpu/build_model.py --prompts)")
    p.add_argument(
        "--shape-config", required=True, help="vime's YAML of the run to match, e.g. bench/gpu/colocated_0.5b.yaml"
    )
    p.add_argument("--steps", type=int, default=8, help="optimizer steps to time")
    p.add_argument("--out", required=True, help="the JSON written")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations (when memory needs it)")
    p.add_argument(
        "--t0", type=float, default=T_START, help="epoch seconds of the command (default: this process's start)"
    )
    a = p.parse_args(argv)
    cfg = load_config(a.shape_config, {"hf_checkpoint": a.model}).model_dump()
    try:
        settings = peer_settings(cfg)
    except ValueError as exc:
        raise SystemExit(f"--shape-config {a.shape_config}: {exc}") from None
    settings["gradient_checkpointing"] = a.gradient_checkpointing
    times = StepTimes()
    run = train(a, cfg, settings, times)
    result = {
        "peer": "trl",
        "trl_version": run.pop("trl_version"),
        "vllm_version": run.pop("vllm_version"),
        "model": a.model,
        "prompts": a.prompts,
        "shape_config": a.shape_config,
        "settings": {**settings, **run.pop("derived"), "max_steps": a.steps},
        **summarize(times, a.t0),
        **run,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "settings"}))
    return 1 if result["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
