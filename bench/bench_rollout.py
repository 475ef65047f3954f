"""Rollout throughput through vime (RolloutManager -> real vllm-router -> one vLLM CPU server -> reward)
against the same token ids sent straight to the server and against transformers `generate`, on a
tiny-vocabulary model (so the figures are the transformer body's), fixed-length responses; and the
framework's own cost per 256 samples with a zero-latency stub engine. Ratios are vime/direct and
vime/transformers, medians over interleaved repeats.

    bench/run.py rollout [--groups G] [--repeats N]"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vime_core.config import make_config  # noqa: E402
from vime_core.data.batch import build_batch  # noqa: E402
from vime_core.data.data_source import DataSource  # noqa: E402
from vime_core.demo.model import CHARACTERS, SPECIAL_TOKENS, VOCAB, build_tiny_model  # noqa: E402
from vime_core.engines.client import EngineClient  # noqa: E402
from vime_core.rewards.filters import keep_all  # noqa: E402
from vime_core.rewards.hub import RewardHub  # noqa: E402
from vime_core.rollout.generate import generate_sample  # noqa: E402
from vime_core.rollout.loop import RolloutState, generate_rollout  # noqa: E402
from vime_core.rollout.manager import RolloutManager  # noqa: E402

PROMPT_CHARS, NEW_TOKENS, GROUP_SIZE = 31, 64, 4
OVERHEAD_SAMPLES = 256  # the reference implementation's figure is per 256 samples
OVERHEAD_GROUPS = OVERHEAD_SAMPLES // GROUP_SIZE
SHAPE = dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64, intermediate_size=2048)


async def ignore_eos_generate(ctx, sample, params):
    """Fixed-length responses so every path generates the same number of tokens."""
    params["ignore_eos"] = True
    return await generate_sample(ctx, sample, params)


def write_prompts(path: Path, groups: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    digits = [c for c in CHARACTERS if c.isdigit()]
    rows = []
    for g in range(groups):
        a = "".join(rng.choice(digits) for _ in range(PROMPT_CHARS - 1))
        rows.append({"prompt_id": f"p{g}", "prompt": a + "=", "label": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_cfg(model_dir: Path, data: Path, groups: int, **extra):
    values = {
        "hf_checkpoint": str(model_dir),
        "prompt_data": str(data),
        "rollout_batch_size": groups,
        "n_samples_per_prompt": GROUP_SIZE,
        "rollout_max_prompt_len": 64,
        "rollout_max_response_len": NEW_TOKENS,
        "rm_type": "arith",
        "rollout_shuffle": False,
        "router_policy": "round_robin",
        "custom_generate_function_path": f"{Path(__file__).resolve()}:ignore_eos_generate",
        "vllm_server_concurrency": 256,
        "engine_startup_timeout_s": 900,
        "device": "cpu",
        "bf16": False,
    }
    values.update(extra)
    return make_config(values)


def prompt_ids(manager, groups: int) -> list[list[int]]:
    rows = manager.data_source.rows[:groups]
    return [list(r.tokens) for r in rows for _ in range(GROUP_SIZE)]


def vime_rollout(manager, rollout_id: int) -> tuple[float, int, dict]:
    t0 = time.perf_counter()
    samples, metrics = manager.generate_samples(rollout_id)
    wall = time.perf_counter() - t0
    return wall, sum(s.response_length for s in samples), metrics


def direct_rollout(url: str, prompts: list[list[int]], token) -> tuple[float, int]:
    async def go():
        params = {
            "max_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "logprobs": 0,
            "ignore_eos": True,
        }
        async with EngineClient(url, "direct", token=token) as client:
            t0 = time.perf_counter()
            answers = await asyncio.gather(*(client.generate(p, params) for p in prompts))
            return time.perf_counter() - t0, sum(len(a["choices"][0]["token_ids"]) for a in answers)

    return asyncio.run(go())


def transformers_rollout(model_dir: Path, prompts: list[list[int]]) -> tuple[float, int]:
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)  # all prompts have the same length: no padding
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            pad_token_id=0,
        )
        wall = time.perf_counter() - t0
    return wall, int((out.shape[1] - ids.shape[1]) * out.shape[0])


def overhead_per_256(model_dir: Path, data: Path) -> dict:
    """The loop + build_batch with an engine that answers instantly (256 samples)."""
    cfg = make_cfg(model_dir, data, OVERHEAD_GROUPS, custom_generate_function_path="")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokens = [len(SPECIAL_TOKENS) + i % len(CHARACTERS) for i in range(NEW_TOKENS)]  # character ids
    answer = {
        "choices": [
            {
                "token_ids": tokens,
                "finish_reason": "length",
                "logprobs": {"content": [{"token_id": t, "logprob": -1.5} for t in tokens]},
                "weight_versions": [{"version": "1", "start": 0, "end": NEW_TOKENS}],
            }
        ],
        "usage": {"completion_tokens": NEW_TOKENS},
    }

    class InstantEngine:
        name = "instant"

        async def generate(self, token_ids, sampling_params, session_id=None, request_id=None):
            return json.loads(json.dumps(answer))  # a fresh body, as if decoded from HTTP

        async def abort_requests(self):
            return 0

    times = []
    for _ in range(5):
        state = RolloutState(
            cfg=cfg,
            data_source=DataSource(cfg, tokenizer=tokenizer),
            reward_hub=RewardHub(cfg),
            generator=InstantEngine(),
            engines=[],
            tokenizer=tokenizer,
            group_filter=keep_all,
            eos_token_id=tokenizer.eos_token_id,
            concurrency=OVERHEAD_SAMPLES,
        )
        t0 = time.perf_counter()
        samples, _ = asyncio.run(generate_rollout(state, 0))
        build_batch(samples, cfg)
        times.append(time.perf_counter() - t0)
    assert len(samples) == OVERHEAD_SAMPLES
    return {"framework_s_per_256": statistics.median(times), "repeats": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=16, help="groups per rollout (x4 samples)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="also write the JSON here (after each stage)")
    args = parser.parse_args()

    cache = REPO / ".cache" / "bench"
    model_dir = build_tiny_model(cache / "models" / "rollout-85m", family="qwen3", seed=0, **SHAPE)
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    data = write_prompts(work / "prompts.jsonl", max(args.groups, OVERHEAD_GROUPS))
    cfg = make_cfg(model_dir, data, args.groups)
    out = Path(args.out) if args.out else None
    result: dict = {
        "bench": "bench_rollout",
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg(),
        },
        "model": {"params_m": round(model_params(model_dir) / 1e6, 1), "vocab": len(VOCAB), **SHAPE},
        "targets": {"vime_vs_direct": 0.95, "vime_vs_transformers": 1.5, "overhead_pct_per_256": 1.0},
    }

    def save(stage: str) -> None:
        """Results so far (a long run on a busy machine keeps what it measured)."""
        result["complete"] = stage == "done"
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"[bench_rollout] {stage} done", file=sys.stderr, flush=True)

    # The framework alone first, then transformers before any vLLM server exists (no idle
    # server beside it), then vLLM direct and through vime, interleaved per repeat.
    result.update(overhead_per_256(model_dir, data))
    save("overhead")
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        list(tok.encode(json.loads(line)["prompt"]))
        for line in data.read_text().splitlines()[: args.groups]
        for _ in range(GROUP_SIZE)
    ]
    hf = [transformers_rollout(model_dir, prompts) for _ in range(args.repeats)]
    hf_tps = [t / w for w, t in hf]
    result["transformers_tokens_per_s"] = statistics.median(hf_tps)
    result["workload"] = {
        "samples": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "new_tokens": NEW_TOKENS,
        "repeats": args.repeats,
    }
    save("transformers")

    manager = RolloutManager(cfg, log_dir=str(cache / "logs"))
    try:
        url = manager.engine_urls()[0]
        assert prompts == prompt_ids(manager, args.groups), "the data source tokenised differently"
        # Warm both paths once (first requests pay one-off set-up costs).
        vime_rollout(manager, -1)
        direct_rollout(url, prompts, manager.engine_token())
        vime, direct, phase = [], [], []
        for r in range(args.repeats):
            wall, tokens, metrics = vime_rollout(manager, r)
            vime.append(tokens / wall)
            phase.append(metrics)
            wall, tokens = direct_rollout(url, prompts, manager.engine_token())
            direct.append(tokens / wall)
        vime_tps, direct_tps = statistics.median(vime), statistics.median(direct)
        result.update(
            {
                "vime_tokens_per_s": vime_tps,
                "direct_vllm_tokens_per_s": direct_tps,
                "ratio_vime_vs_direct": vime_tps / direct_tps,
                "ratio_vime_vs_transformers": vime_tps / result["transformers_tokens_per_s"],
                "ratio_direct_vs_transformers": direct_tps / result["transformers_tokens_per_s"],
                "samples": {"vime": vime, "direct": direct, "transformers": hf_tps},
                "loop_phase_s_median": {
                    k: statistics.median(m[k] for m in phase) for k in phase[0] if k.startswith("rollout/time_")
                },
            }
        )
        save("vllm")
        # Framework overhead at 256 samples: the real rollout time of 256 samples, once.
        manager.cfg.rollout_batch_size = OVERHEAD_GROUPS
        wall_256, tokens_256, metrics_256 = vime_rollout(manager, 100)
    finally:
        manager.shutdown()
    result["rollout_256"] = {
        "wall_s": wall_256,
        "tokens": tokens_256,
        "loop_time_abort_s": metrics_256["rollout/time_abort_s"],
        "loop_time_finalize_s": metrics_256["rollout/time_finalize_s"],
        "loop_time_reward_s": metrics_256["rollout/time_reward_s"],
    }
    result["overhead_pct_per_256"] = 100.0 * result["framework_s_per_256"] / wall_256
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    save("done")
    print(json.dumps(result, indent=2))


def model_params(model_dir: Path) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())


def _prod(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


if __name__ == "__main__":
    main()
