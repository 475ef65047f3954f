"""Reading an HF checkpoint shard file by shard file into one TP rank's Megatron tensors: the
same tensors as the whole checkpoint in memory (hf_to_megatron_shard), for a >= 3-shard
checkpoint with an index and for a single file, at TP=1 and TP=2; a rank reads only its slices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_trainer_hf_convert import _random_hf
from vime_core.demo.model import tiny_config
from vime_core.trainer.hf_convert import (
    SAFETENSORS_INDEX,
    CheckpointMismatchError,
    conversion_rules,
    hf_to_megatron_shard,
    iter_megatron_shard,
    read_hf_safetensors,
)
from vime_core.trainer.model import architecture_from_hf


def write_sharded(tensors: dict[str, torch.Tensor], folder: Path, shards: int) -> Path:
    """HF's sharded layout: model-0000k-of-0000n.safetensors + model.safetensors.index.json.
    Names go round-robin, so q/k/v and gate/up of one layer land in different files."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    weight_map = {name: files[i % shards] for i, name in enumerate(names)}
    for k, file in enumerate(files):
        save_file({n: tensors[n].contiguous() for n in names if weight_map[n] == file}, str(folder / file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


def _single(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(folder / "model.safetensors"))
    return folder


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False), ("llama", False)])
@pytest.mark.parametrize("tp", [1, 2])
def test_sharded_and_single_file_give_the_in_memory_shards(tmp_path, family, tie, tp):
    arch = architecture_from_hf(tiny_config(family, tie_word_embeddings=tie, num_heads=4, num_kv_heads=2))
    hf = _random_hf(arch, tie)
    sharded = write_sharded(hf, tmp_path / "sharded", shards=4)
    single = _single(hf, tmp_path / "single")
    assert len(list(sharded.glob("*.safetensors"))) == 4
    for rank in range(tp):
        want = hf_to_megatron_shard(hf, arch, tp, rank)
        _assert_same(dict(iter_megatron_shard(sharded, arch, tp, rank)), want)
        _assert_same(dict(iter_megatron_shard(single, arch, tp, rank)), want)


def test_save_pretrained_shards_load_like_the_single_file(tmp_path, tiny_model_dir):
    """A checkpoint sharded by transformers itself (max_shard_size) reads like the unsharded one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    model.save_pretrained(str(tmp_path), max_shard_size="300KB")
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) >= 3 and (tmp_path / SAFETENSORS_INDEX).is_file()
    arch = architecture_from_hf(json.loads((tiny_model_dir / "config.json").read_text()))
    whole = read_hf_safetensors(tiny_model_dir)
    assert sorted(read_hf_safetensors(tmp_path)) == sorted(whole)
    for tp in (1, 2):
        for rank in range(tp):
            _assert_same(
                dict(iter_megatron_shard(tmp_path, arch, tp, rank)), hf_to_megatron_shard(whole, arch, tp, rank)
            )


class _Recorder:
    """safe_open stand-in that records each file opened and the size of every tensor read."""

    def __init__(self, real):
        self.real, self.opened, self.read = real, [], {}

    def __call__(self, path, framework="pt", **kw):
        self.opened.append(Path(path).name)
        recorder, handle = self, self.real(path, framework=framework, **kw)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                raise AssertionError(f"{name}: read whole")

            def get_slice(self, name):
                view = handle.get_slice(name)

                class Slice:
                    def get_shape(self):
                        return view.get_shape()

                    def __getitem__(self, index):
                        tensor = view[index]
                        recorder.read[name] = recorder.read.get(name, 0) + tensor.numel()
                        return tensor

                return Slice()

        return Handle()


def test_a_tp_rank_reads_only_its_slices_and_each_file_once(tmp_path, monkeypatch):
    import safetensors

    from vime_core.trainer import hf_convert

    arch = architecture_from_hf(tiny_config("qwen3", tie_word_embeddings=False, num_heads=4, num_kv_heads=2))
    hf = _random_hf(arch, False)
    folder = write_sharded(hf, tmp_path, shards=3)
    split = {n for rule in conversion_rules(arch) if rule.kind != "replicated" for n in rule.hf}
    per_rank = []
    for rank in range(2):
        recorder = _Recorder(safetensors.safe_open)
        monkeypatch.setattr(hf_convert, "safe_open", recorder)
        shard = dict(iter_megatron_shard(folder, arch, 2, rank))
        monkeypatch.undo()
        assert sorted(recorder.opened) == sorted({p.name for p in folder.glob("*.safetensors")})  # once each
        assert sorted(recorder.read) == sorted(hf)
        for name, numel in recorder.read.items():
            full = hf[name].numel()
            if name in split and "embed_tokens" not in name and "lm_head" not in name:
                assert numel == full // 2, name
            elif name in split:  # 19 vocabulary rows, padded to 20: rank 0 reads 10, rank 1 reads 9
                assert numel == full * (10 - rank) // 19, name
            else:
                assert numel == full, name
        per_rank.append(shard)
    assert sum(recorder.read[n] for n in split) < sum(hf[n].numel() for n in split)
    _assert_same(per_rank[1], hf_to_megatron_shard(hf, arch, 2, 1))


def test_index_naming_a_missing_shard_or_tensor_is_refused(tmp_path):
    arch = architecture_from_hf(tiny_config("qwen3", num_heads=4, num_kv_heads=2))
    hf = _random_hf(arch, True)
    folder = write_sharded(hf, tmp_path / "a", shards=3)
    (folder / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        dict(iter_megatron_shard(folder, arch, 1, 0))
    hf.pop("model.norm.weight")
    folder = write_sharded(hf, tmp_path / "b", shards=3)
    with pytest.raises(CheckpointMismatchError, match=r"missing: \['model.norm.weight'\]"):
        dict(iter_megatron_shard(folder, arch, 1, 0))
