"""vLLM's offline `LLM.generate` on given token-id prompts: the rollout's upper bound on one GPU. Runs
under the vLLM interpreter in its own process; the engine keeps the server flags that change speed
(the others go to `dropped_flags`). One warm-up, then --repeats timed calls:
output tokens/s = output tokens / wall seconds of one call.

    python offline_generate.py --prompts p.json --server-flags '["--model", "M", ...]' \
        --sampling '{"temperature": 1.0, "max_tokens": 1024}' --repeats 3"""

from __future__ import annotations

import argparse
import json
import statistics
import time

# server flag -> (LLM keyword, type); a flag without a value is a bool switch
ENGINE_FLAGS = {
    "--model": ("model", str),
    "--dtype": ("dtype", str),
    "--max-model-len": ("max_model_len", int),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--seed": ("seed", int),
    "--logprobs-mode": ("logprobs_mode", str),
    "--enable-sleep-mode": ("enable_sleep_mode", None),
    "--enforce-eager": ("enforce_eager", None),
}


def engine_kwargs(flags: list[str]) -> tuple[dict, list[str]]:
    """LLM keywords from a server command's flags, and the flags left out."""
    kwargs, dropped, i = {}, [], 0
    while i < len(flags):
        flag = flags[i]
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if flag in ENGINE_FLAGS:
            name, kind = ENGINE_FLAGS[flag]
            kwargs[name] = True if kind is None else kind(flags[i + 1])
        else:
            dropped.append(flag)
        i += 2 if has_value else 1
    return kwargs, dropped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--server-flags", required=True, help="JSON list: the server command's flags")
    p.add_argument("--sampling", required=True, help="JSON dict of SamplingParams keywords")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)

    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams  # boundary: the offline engine's start-up counts vllm's import

    prompts = [{"prompt_token_ids": ids} for ids in json.loads(open(a.prompts).read())]
    kwargs, dropped = engine_kwargs(json.loads(a.server_flags))
    llm = LLM(skip_tokenizer_init=True, **kwargs)
    t_ready = time.perf_counter() - t_start
    sampling = json.loads(a.sampling)
    # token ids out, no text: the rollout decodes itself
    params = SamplingParams(**{**sampling, "detokenize": False})

    llm.generate(prompts[: max(1, len(prompts) // 8)], params, use_tqdm=False)  # warm-up
    runs = []
    for _ in range(a.repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        runs.append({"wall_s": wall, "output_tokens": tokens, "tokens_per_s": tokens / wall})
    result = {
        "engine_kwargs": kwargs,
        "dropped_flags": dropped,
        "sampling": sampling,
        "prompts": len(prompts),
        "ready_s": t_ready,
        "runs": runs,
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
        "wall_s_median": statistics.median(r["wall_s"] for r in runs),
    }
    text = json.dumps(result, indent=1)
    if a.out:
        open(a.out, "w").write(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
