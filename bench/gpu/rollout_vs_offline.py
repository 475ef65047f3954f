"""The rollout's generation through vime's vLLM server against vLLM's offline `LLM.generate`, on one GPU,
with the same prompts, engine flags and sampling parameters:

    ratio(variant) = server output tokens/s / offline output tokens/s      (medians)

Request variants, measured interleaved with the prefix cache reset before each: vime (what a run
sends), logprobs, nologprobs, tokens (no detokenization), each optionally with MODIFIERS
(e.g. logprobs+final+nodetok). --server-variants (`;`-separated; `name=value` configuration fields
or `env:NAME=value`; `default` for none) start one server each, one after the other.

    python bench/gpu/rollout_vs_offline.py --config bench/gpu/colocated_0.5b.yaml \
        --hf-checkpoint M --prompt-data P --out rollout.json"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from gpu_common import write_json  # noqa: E402

from vime_core.config import make_config, rollout_concurrency  # noqa: E402
from vime_core.config.loader import load_config  # noqa: E402
from vime_core.data.data_source import load_prompt_rows, load_tokenizer  # noqa: E402
from vime_core.engines.client import EngineClient  # noqa: E402
from vime_core.engines.server import EngineServer, resolve_python  # noqa: E402
from vime_core.rollout.generate import base_sampling_params, request_params  # noqa: E402


def run_prompts(cfg) -> list[list[int]]:
    """Token ids of one rollout's samples: the first prompts, each n_samples_per_prompt times."""
    rows = load_prompt_rows(cfg.prompt_data, cfg, load_tokenizer(cfg))
    # as the data source does, a prompt set smaller than a rollout is taken again from its start
    return [
        list(rows[i % len(rows)].tokens) for i in range(cfg.rollout_batch_size) for _ in range(cfg.n_samples_per_prompt)
    ]


# request variant modifiers ("+name" after a variant): SamplingParams fields the token endpoint
# accepts in its `sampling_params`
MODIFIERS = {
    "final": {"output_kind": 2},  # RequestOutputKind.FINAL_ONLY: no per-step output object
    "flat": {"flat_logprobs": True},  # log-probs kept as flat lists, not a dict per token
    "detok": {"detokenize": True},
    "nodetok": {"detokenize": False},
}


# what --ignore-eos adds to every request, offline's included
EVERY_REQUEST: dict = {}


def variant_params(cfg, variant: str) -> dict:
    name, *modifiers = variant.split("+")
    unknown = [m for m in modifiers if m not in MODIFIERS]
    if unknown or name not in ("vime", "logprobs", "nologprobs", "tokens"):
        raise SystemExit(f"--variants: {variant!r} is not vime|logprobs|nologprobs|tokens[+{'|'.join(MODIFIERS)}...]")
    params = request_params(base_sampling_params(cfg), cfg.rollout_max_response_len)
    if name == "logprobs":
        params["logprobs"] = 0
    elif name in ("nologprobs", "tokens"):
        params.pop("logprobs", None)
    if name in ("logprobs", "nologprobs"):
        params["detokenize"] = True
    elif name == "tokens":
        params["detokenize"] = False
    for m in modifiers:
        params.update(MODIFIERS[m])
    params.update(EVERY_REQUEST)
    return params


def offline(cfg, prompts: list[list[int]], flags: list[str], params: dict, repeats: int, work: Path) -> dict:
    prompt_file = work / "prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    sampling = {k: v for k, v in params.items() if k != "skip_special_tokens"}
    cmd = [
        str(resolve_python(cfg.vllm_python)),
        str(REPO / "bench" / "gpu" / "offline_generate.py"),
        "--prompts",
        str(prompt_file),
        "--server-flags",
        json.dumps(flags),
        "--sampling",
        json.dumps(sampling),
        "--repeats",
        str(repeats),
        "--out",
        str(work / "offline.json"),
    ]
    subprocess.run(cmd, check=True, cwd=REPO)
    return json.loads((work / "offline.json").read_text())


async def through_server(
    url: str, prompts: list[list[int]], params: dict, concurrency: int, max_context_len: int | None = None, token=None
) -> dict:
    """Every prompt once, straight to the server, `concurrency` in flight (prefix cache reset
    first); with `max_context_len`, max_tokens is cut to the room each prompt leaves, as
    rollout/generate does."""
    gate = asyncio.Semaphore(concurrency)
    async with EngineClient(url, timeout_s=1800.0, max_connections=max(64, concurrency * 2), token=token) as client:
        await client.reset_prefix_cache()

        async def one(tokens: list[int]) -> int:
            asked = params
            if max_context_len is not None:
                asked = dict(params, max_tokens=min(params["max_tokens"], max_context_len - len(tokens)))
            async with gate:
                answer = await client.generate(tokens, asked)
            return len(answer["choices"][0]["token_ids"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": sum(counts), "tokens_per_s": sum(counts) / wall}


def serve_and_measure(
    cfg, extra_flags: list[str], prompts: list[list[int]], variants: list[str], repeats: int, offline_tps: float | None
) -> dict:
    """One server for the configuration (plus `extra_flags`); each request variant `repeats`
    times, interleaved."""
    env = dict(word[len("env:") :].split("=", 1) for word in extra_flags if word.startswith("env:"))
    words = [word for word in extra_flags if not word.startswith("env:")]
    fields = dict(word.split("=", 1) for word in words if not word.startswith("-") and "=" in word)
    flags = [word for word in words if word.startswith("-") or "=" not in word]
    varied = make_config({**cfg.model_dump(), **fields, "vllm_extra_args": list(cfg.vllm_extra_args) + flags})
    server = EngineServer(varied, extra_env=env)
    t0 = time.perf_counter()
    url = server.start()
    out: dict = {"ready_s": time.perf_counter() - t0, "extra_flags": extra_flags, "startup": server.startup_marks()}
    try:
        runs: dict[str, list] = {v: [] for v in variants}
        for _ in range(repeats):
            for v in variants:
                runs[v].append(
                    asyncio.run(
                        through_server(
                            url, prompts, variant_params(cfg, v), rollout_concurrency(cfg), token=server.auth_token
                        )
                    )
                )
    finally:
        server.shutdown()
    for v, rs in runs.items():
        tps = statistics.median(r["tokens_per_s"] for r in rs)
        out[v] = {
            "runs": rs,
            "tokens_per_s_median": tps,
            "vs_offline": tps / offline_tps if offline_tps else None,
            "params": variant_params(cfg, v),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--prompt-data", required=True)
    p.add_argument("--variants", default="vime,logprobs,nologprobs,tokens")
    p.add_argument("--server-variants", default="default")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every sample runs to max_tokens (a random model's EOS would end it early)",
    )
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)

    cfg = load_config(a.config, {"hf_checkpoint": a.hf_checkpoint, "prompt_data": a.prompt_data})
    if a.ignore_eos:
        EVERY_REQUEST["ignore_eos"] = True
    prompts = run_prompts(cfg)
    variants = a.variants.split(",")
    server = EngineServer(cfg)
    command = server.command(0)
    flags = command[command.index("--model") :]  # after the interpreter and vLLM's entry point
    result: dict = {
        "bench": "rollout_vs_offline",
        "samples": len(prompts),
        "prompt_tokens_mean": statistics.mean(len(t) for t in prompts),
        "concurrency": rollout_concurrency(cfg),
        "server_flags": flags,
    }
    with tempfile.TemporaryDirectory() as tmp:
        if not a.skip_offline:
            result["offline"] = offline(cfg, prompts, flags, variant_params(cfg, "vime"), a.repeats, Path(tmp))
    offline_tps = result.get("offline", {}).get("tokens_per_s_median")
    result["servers"] = {}
    for server_variant in a.server_variants.split(";"):
        extra = [] if server_variant == "default" else server_variant.split()
        try:
            result["servers"][server_variant] = serve_and_measure(cfg, extra, prompts, variants, a.repeats, offline_tps)
        except Exception as exc:  # a bench of alternatives: one that does not serve is a finding, not the end
            result["servers"][server_variant] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        result["server"] = result["servers"][a.server_variants.split(";")[0]]
        write_json(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
