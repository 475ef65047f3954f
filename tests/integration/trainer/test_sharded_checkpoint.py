"""A checkpoint sharded by transformers (>= 3 safetensors files + index) loads into the Megatron
model exactly like the single-file one: at TP=1 in this process and at TP=2 over gloo, where
each rank reads its slices only (tests/unit/test_hf_sharded_load.py counts them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn


def _sharded_copy(ckpt: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    model.save_pretrained(str(out), max_shard_size="300KB")
    assert len(list(out.glob("*.safetensors"))) >= 3 and (out / "model.safetensors.index.json").is_file()
    return out


def _load(ckpt, arch, tp: int, rank: int):
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import build_gpt_model

    model = build_gpt_model(arch, tp_size=tp)
    load_hf_into_model(model, ckpt, arch, tp=tp, rank=rank)
    return model


def compare_ranks(rank: int, world_size: int, port: int, single: str, sharded: str, out: str) -> None:
    """One TP rank: the Megatron parameters loaded from both checkpoints, and the TP-gathered
    HF weights of the sharded load against the single file's tensors."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.hf_convert import iter_hf_weights, read_hf_safetensors
    from vime_core.trainer.model import architecture_from_hf, read_hf_config
    from vime_core.trainer.parallel import destroy_parallel, init_parallel

    init_parallel(rank, world_size, "127.0.0.1", port, tp_size=world_size)
    seed_everything(0)
    arch = architecture_from_hf(read_hf_config(single))
    a, b = _load(single, arch, world_size, rank), _load(sharded, arch, world_size, rank)
    params_b = dict(b.named_parameters())
    same_params = all(torch.equal(p, params_b[n]) for n, p in a.named_parameters())
    source = read_hf_safetensors(single)
    gathered = dict(iter_hf_weights(b))
    round_trip = sorted(gathered) == sorted(source) and all(torch.equal(gathered[n], t) for n, t in source.items())
    torch.save({"same_params": same_params, "round_trip": round_trip}, Path(out) / f"rank{rank}.pt")
    destroy_parallel()


@pytest.fixture(scope="module")
def checkpoints(cache_dir, tmp_path_factory):
    single = tiny_checkpoint(cache_dir, "qwen3", False)
    return single, _sharded_copy(single, tmp_path_factory.mktemp("sharded"))


def test_sharded_load_equals_single_file_tp1(single_rank, checkpoints):
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.model import architecture_from_hf, read_hf_config

    single, sharded = checkpoints
    seed_everything(0)
    arch = architecture_from_hf(read_hf_config(single))
    a, b = _load(single, arch, 1, 0), _load(sharded, arch, 1, 0)
    params_b = dict(b.named_parameters())
    for name, param in a.named_parameters():
        assert torch.equal(param, params_b[name]), name


@pytest.mark.slow
def test_sharded_load_equals_single_file_tp2(checkpoints, tmp_path):
    single, sharded = checkpoints
    spawn(compare_ranks, 2, str(single), str(sharded), str(tmp_path))
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result == {"same_params": True, "round_trip": True}, rank
