"""How far a bf16 forward's sampled-token log-probs fall from fp32's, on the GPU colocated step's model
and prompts: the tolerance the run's engine-vs-trainer log-prob difference (--get-mismatch-metrics)
is judged against. Two bf16 implementations each within e of fp32 are within 2e of each other:

    e = mean over response tokens |log p_bf16(y_t) - log p_fp32(y_t)|,   tolerance = 2 e
    ratio = the GPU run's mean |engine - trainer| / tolerance    (from the latest colocated_step row)

    bench/run.py bf16_noise                 # python bench/bench_bf16_noise.py --samples 4 --out F"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from gpu_common import write_json  # noqa: E402

RESULTS = REPO / "bench" / "results" / "colocated_step.jsonl"


def sampled_log_probs(model, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log p(y_t | y_<t) of the response tokens (positions prompt_len..), fp32 log_softmax."""
    with torch.no_grad():
        logits = model(tokens.unsqueeze(0)).logits[0, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[prompt_len:].unsqueeze(-1)).squeeze(-1)


def gpu_run_difference() -> dict | None:
    """The latest colocated_step row with the engine-vs-trainer difference: its value and SHA."""
    if not RESULTS.exists():
        return None
    found = None
    for line in RESULTS.read_text().splitlines():
        row = json.loads(line)
        diff = (row.get("figures", {}).get("vime") or {}).get("rollout_logprob_abs_diff")
        if diff is not None:
            found = {"mean_abs_diff": diff, "sha": row.get("sha"), "machine": row.get("machine")}
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompt_file = Path(tmp) / "model", Path(tmp) / "prompts.jsonl"
        subprocess.run(
            [
                sys.executable,
                str(REPO / "bench/gpu/build_model.py"),
                "--shape",
                a.shape,
                "--out",
                str(model_dir),
                "--prompts",
                str(prompt_file),
                "--prompt-tokens",
                str(a.prompt_tokens),
                "--seed",
                str(a.seed),
            ],
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        tok = AutoTokenizer.from_pretrained(model_dir)
        rows = [json.loads(line) for line in prompt_file.read_text().splitlines()[: a.samples]]
        prompts = [tok.encode(r["prompt"]) for r in rows]  # as build_model.py counts them
        fp32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        torch.manual_seed(a.seed)
        sequences = []
        for ids in prompts:
            with torch.no_grad():
                out = fp32.generate(
                    torch.tensor([ids]),
                    do_sample=True,
                    temperature=1.0,
                    top_p=1.0,
                    top_k=0,
                    max_new_tokens=a.response_len,
                    min_new_tokens=a.response_len,
                )
            sequences.append((out[0], len(ids)))
        t_sampled = time.perf_counter()
        ref = [sampled_log_probs(fp32, s, n) for s, n in sequences]
        bf16 = fp32.to(torch.bfloat16)
        low = [sampled_log_probs(bf16, s, n) for s, n in sequences]
    diffs = torch.cat([(l - r).abs() for l, r in zip(low, ref)])
    e = float(diffs.mean())
    result = {
        "bench": "bf16_noise",
        "shape": a.shape,
        "samples": a.samples,
        "prompt_tokens": a.prompt_tokens,
        "response_len": a.response_len,
        "response_tokens": int(diffs.numel()),
        "device": "cpu",
        "mean_abs_bf16_vs_fp32": e,
        "max_abs_bf16_vs_fp32": float(diffs.max()),
        "per_sample_mean_abs": [float((l - r).abs().mean()) for l, r in zip(low, ref)],
        "mean_log_prob_fp32": statistics.fmean(float(r.mean()) for r in ref),
        "tolerance": 2 * e,
        "seconds": {"sample": t_sampled - t0, "total": time.perf_counter() - t0},
    }
    gpu = gpu_run_difference()
    if gpu:
        result["gpu_run"] = gpu
        result["ratio_gpu_run_over_tolerance"] = gpu["mean_abs_diff"] / result["tolerance"]
    write_json(result, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
