"""The GPU bench's 14b LoRA run (issue 41) on the CPU: bench/gpu/build_model.py's path for a dense
shape too large for transformers' CPU initialisation (gpu_common.write_random_checkpoint's tensors,
with an untied LM head and Qwen3's q/k norms, read by transformers and by the trainer's HF converter),
and bench/gpu/colocated_14b.yaml through `vime train`'s own parser."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from safetensors.torch import load_file

from tests.bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "bench" / "gpu" / "colocated_14b.yaml"


build_model = load_bench("gpu/build_model.py", "bench_build_model")
gpu_common = sys.modules["gpu_common"]


def test_a_dense_shape_past_the_cpu_limit_is_drawn_as_a_whole_untied_checkpoint(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vime_core.trainer.hf_convert import hf_to_megatron_shard, read_hf_safetensors
    from vime_core.trainer.model import architecture_from_hf, read_hf_config

    shape = "tiny-untied"  # the 14b's layout (qwen3, lm_head of its own) at the tiny shape's size
    monkeypatch.setitem(gpu_common.SHAPES, shape, dict(gpu_common.SHAPES["tiny"], tie_word_embeddings=False))
    cfg = gpu_common.hf_config(shape)
    monkeypatch.setattr(build_model, "CPU_INIT_MAX_PARAMETERS", gpu_common.parameter_counts(cfg)["total"] - 1)
    path = build_model.build(shape, tmp_path / "model", seed=3)

    tensors = load_file(str(path / "model.safetensors"))
    assert set(tensors) == set(gpu_common.hf_tensor_shapes(cfg))  # write_random_checkpoint's, all of them
    assert not tensors["lm_head.weight"].equal(tensors["model.embed_tokens.weight"])
    model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.config.tie_word_embeddings
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert AutoTokenizer.from_pretrained(str(path)).eos_token_id == model.config.eos_token_id
    arch = architecture_from_hf(read_hf_config(path))
    shard = hf_to_megatron_shard(read_hf_safetensors(path), arch, 1, 0, source=str(path))
    assert "output_layer.weight" in shard and not arch.tie_word_embeddings
    # the same seed draws the same checkpoint (the folder exists: nothing is drawn again)
    again = build_model.build(shape, tmp_path / "again", seed=3)
    assert load_file(str(again / "model.safetensors"))["lm_head.weight"].equal(tensors["lm_head.weight"])


def test_the_14b_config_trains_lora_merged_with_an_explicit_kv_cache(tmp_path):
    from flows.cli import _config_from, _config_parser
    from vime_core.config.derive import engine_server_args
    from vime_core.config.lora import lora_enabled

    argv = ["--config", str(CONFIG), "--run-name", "lora-14b", "--num-rollout", "2", "--ray-address", "127.0.0.1:6379"]
    argv += ["--storage-uri", str(tmp_path / "runs"), "--hf-checkpoint", str(tmp_path / "model")]
    argv += ["--prompt-data", str(tmp_path / "p.jsonl"), "--eval-prompt-data", str(tmp_path / "p.jsonl")]
    parser = _config_parser("vime train")
    cfg = _config_from(vars(parser.parse_args(argv)), parser)
    assert lora_enabled(cfg) and cfg.lora_publish == "merged" and cfg.lora_rank == 64
    assert cfg.device == "cuda" and cfg.colocate and cfg.offload_rollout and cfg.offload_train
    assert not cfg.export_hf  # the PEFT adapter alone
    server = engine_server_args(cfg)
    kv = [a for a in yaml.safe_load(CONFIG.read_text())["vllm_extra_args"] if a.startswith("--kv-cache-memory=")]
    assert len(kv) == 1 and kv[0] in cfg.vllm_extra_args  # the YAML's KV size is the run's
    assert not server.get("enable_lora")  # merged: the engine serves plain weights
