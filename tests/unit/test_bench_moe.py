"""The GPU bench's MoE shape on the CPU: its parameter counts against the tensors a checkpoint holds,
bench/gpu/build_model.py's checkpoint read by transformers and by the trainer's HF converter, the
run's configuration through `vime train`'s own parser with and without routing replay, and the
report's MoE keys."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "bench" / "gpu" / "colocated_moe.yaml"


build_model = load_bench("gpu/build_model.py", "bench_build_model")
gpu_common = sys.modules["gpu_common"]  # build_model put bench/ on the path and imported it
step = load_bench("gpu/bench_colocated_step.py", "bench_colocated_step")

EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.")


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench_moe")
    argv = ["--shape", "tiny-moe", "--out", str(out / "model"), "--prompts", str(out / "p.jsonl")]
    assert build_model.main([*argv, "--prompt-tokens", "48"]) == 0
    return out / "model"


def test_tiny_moe_counts_are_the_written_tensors(tiny_moe):
    """total: every tensor; active: without the experts a token does not reach (all but k per layer),
    i.e. the tensors of experts k..E-1 taken out; the dense FLOP term is 6 x active per token."""
    cfg = json.loads((tiny_moe / "config.json").read_text())
    tensors = load_file(str(tiny_moe / "model.safetensors"))
    counts = gpu_common.parameter_counts(gpu_common.hf_config("tiny-moe"))
    total = sum(t.numel() for t in tensors.values())
    k = cfg["num_experts_per_tok"]
    idle = sum(t.numel() for n, t in tensors.items() if (m := EXPERT.match(n)) and int(m.group(1)) >= k)
    assert counts["total"] == counts["matmul"] == total  # tied: the embedding is the LM head
    assert counts["active"] == total - idle < total
    assert {t.dtype for t in tensors.values()} == {gpu_common.torch.bfloat16}
    tokens = [7, 11]
    assert gpu_common.step_flops(cfg, tokens)["dense"] == 6 * counts["active"] * sum(tokens)
    assert gpu_common.mfu_basis(cfg) == "active"


def test_dense_shapes_count_every_matmul_parameter():
    for shape in ("0.5b", "4b", "tiny"):
        cfg = gpu_common.hf_config(shape)
        counts = gpu_common.parameter_counts(cfg)
        assert "active" not in counts and gpu_common.mfu_basis(cfg) == "matmul"
        assert gpu_common.step_flops(cfg, [5, 9])["dense"] == 6 * counts["matmul"] * 14


def test_tiny_moe_checkpoint_loads_in_transformers_and_the_trainer_converter(tiny_moe):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_core.trainer.hf_convert import hf_to_megatron_shard, read_hf_safetensors
    from vime_core.trainer.model import architecture_from_hf, read_hf_config

    cfg = gpu_common.hf_config("tiny-moe")
    arch = architecture_from_hf(read_hf_config(tiny_moe))
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size, arch.norm_topk_prob) == (
        cfg["num_experts"],
        cfg["num_experts_per_tok"],
        cfg["moe_intermediate_size"],
        True,
    )
    assert arch.tie_word_embeddings
    shard = hf_to_megatron_shard(read_hf_safetensors(tiny_moe), arch, 1, 0, source=str(tiny_moe))
    assert "decoder.layers.1.mlp.router.weight" in shard
    assert f"decoder.layers.0.mlp.experts.local_experts.{cfg['num_experts'] - 1}.linear_fc2.weight" in shard

    model, info = AutoModelForCausalLM.from_pretrained(str(tiny_moe), output_loading_info=True)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = AutoTokenizer.from_pretrained(str(tiny_moe))
    assert tok.eos_token_id == model.config.eos_token_id
    prompts = [json.loads(line) for line in (tiny_moe.parent / "p.jsonl").read_text().splitlines()]
    assert prompts and all(len(tok.encode(p["prompt"])) == 48 for p in prompts)


def _train_config(tmp_path: Path, extra: list[str]):
    """The configuration as `vime train` builds it from run_colocated_h200.sh's command line."""
    from flows.cli import _config_from, _config_parser

    argv = ["--config", str(CONFIG), "--run-name", "moe", "--num-rollout", "4", "--ray-address", "127.0.0.1:6379"]
    argv += ["--storage-uri", str(tmp_path / "runs"), "--hf-checkpoint", str(tmp_path / "model")]
    argv += ["--prompt-data", str(tmp_path / "p.jsonl"), "--eval-prompt-data", str(tmp_path / "p.jsonl"), *extra]
    parser = _config_parser("vime train")
    return _config_from(vars(parser.parse_args(argv)), parser)


@pytest.mark.parametrize("replay", [False, True])
def test_colocated_moe_config_validates_with_and_without_replay(tmp_path, replay):
    from vime_core.config.derive import engine_server_args

    cfg = _train_config(tmp_path, ["--use-rollout-routing-replay"] if replay else [])
    assert cfg.use_rollout_routing_replay is replay
    assert cfg.device == "cuda" and cfg.colocate and cfg.use_distributed_optimizer
    assert cfg.get_mismatch_metrics and cfg.guard_k3_max is None  # measured, never a stop
    assert bool(engine_server_args(cfg).get("enable_return_routed_experts")) is replay


def test_report_counts_moe_mfu_on_active_parameters_and_shows_the_mismatch(tmp_path):
    work = tmp_path / "work"
    (work / "bench" / "train").mkdir(parents=True)
    (work / "runs" / "reports" / "moe").mkdir(parents=True)
    (work / "runs" / "reports" / "moe" / "config.json").write_text(json.dumps({"use_rollout_routing_replay": True}))
    records = [
        {"rollout_id": i, "t_step": 30.0, "t_rollout": 10.0, "t_train": 18.0 + i, "output_tokens": 200_000}
        | {"reused_log_probs": False, "train_rollout_k3_kl": 0.001 * (i + 1), "train_rollout_logprob_abs_diff": 0.02}
        for i in range(3)
    ]
    batches = [
        {"rollout_id": i, "rows": 256, "mean_prompt_length": 512.0, "mean_response_length": 1000.0} for i in range(3)
    ]
    (work / "bench" / "train" / "colocated_moe.json").write_text(json.dumps({"records": records, "batches": batches}))
    a = argparse.Namespace(work=str(work), run_name="moe", shape="moe", prompt_tokens=512, config=CONFIG)
    out = step.phase_report(a, {"results": work / "bench"})
    cfg = gpu_common.hf_config("moe")
    assert out["mfu_basis"] == "active" and out["params"] == gpu_common.parameter_counts(cfg)
    vime = out["vime"]
    assert vime["use_rollout_routing_replay"] is True
    k3 = [r["train_rollout_k3_kl"] for r in records[1:]]  # the first iteration is left out
    assert vime["rollout_k3_kl"] == pytest.approx(sum(k3) / 2) and vime["rollout_k3_kl_max"] == max(k3)
    assert vime["rollout_logprob_abs_diff"] == records[1]["train_rollout_logprob_abs_diff"]
    # iterations 1 and 2 (the first is left out): 4 passes of 6N/3 over 256 x 1512 tokens in t_train
    flops = 8 * out["params"]["active"] * 256 * 1512
    expected = sorted(flops / t / gpu_common.PEAK_BF16_FLOPS for t in (19.0, 20.0))
    assert vime["train_mfu_6N"] == pytest.approx(sum(expected) / 2)
