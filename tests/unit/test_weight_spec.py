"""Checking a publish against an engine's model before anything moves (weight_spec), and the
checkpoint layout the vLLM worker derives that spec from (checkpoint_layout)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from vime_core.weight_sync.weight_spec import WeightSpecError, check_against_spec, fetch_spec
from vime_core.wire.spec_format import read_safetensors_layout

SPEC = {
    "tensors": {
        "a.weight": {"shape": [4, 2], "dtype": "bfloat16"},
        "b.weight": {"shape": [3], "dtype": "bfloat16"},
        "ids": {"shape": [2], "dtype": "int64"},
    }
}


def ok() -> list[tuple[str, torch.Tensor]]:
    return [
        ("a.weight", torch.zeros(4, 2)),
        ("b.weight", torch.zeros(3, dtype=torch.float16)),
        ("ids", torch.zeros(2, dtype=torch.int64)),
    ]


def test_floating_tensors_travel_in_the_served_dtype_others_unchanged():
    assert check_against_spec(ok(), SPEC, "e0") == {
        "a.weight": torch.bfloat16,
        "b.weight": torch.bfloat16,
        "ids": torch.int64,
    }


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t + [("c.weight", torch.zeros(1))], r"engine e0: unknown tensor 'c\.weight'"),
        (lambda t: t[1:], r"engine e0: 1 tensor\(s\) missing, e\.g\. \['a\.weight'\]"),
        (
            lambda t: [("a.weight", torch.zeros(2, 4))] + t[1:],
            r"'a\.weight' has shape \[2, 4\], the model expects \[4, 2\]",
        ),
        (
            lambda t: t[:2] + [("ids", torch.zeros(2))],
            r"'ids' has dtype torch\.float32, the model expects torch\.int64",
        ),
        (lambda t: t + [t[0]], r"'a\.weight' appears twice"),
    ],
    ids=["unknown", "missing", "shape", "dtype", "duplicate"],
)
def test_every_mismatch_names_the_tensor_and_the_engine(edit, message):
    with pytest.raises(WeightSpecError, match=message):
        check_against_spec(edit(ok()), SPEC, "e0")


class RpcStub:
    name = "http://e0"

    def __init__(self, results):
        self.results = results

    async def collective_rpc(self, method, kwargs=None, args=None, timeout_s=None):
        assert method == "vime_weight_spec"
        return self.results


def test_fetch_spec_explains_a_server_without_the_worker_extension():
    with pytest.raises(WeightSpecError, match="worker-extension-cls"):
        asyncio.run(fetch_spec(RpcStub(["method not found"])))


def test_fetch_spec_requires_tp_ranks_to_agree():
    other = {"tensors": {"a.weight": {"shape": [2, 2], "dtype": "bfloat16"}}}
    with pytest.raises(WeightSpecError, match="disagree"):
        asyncio.run(fetch_spec(RpcStub([SPEC, other])))
    assert asyncio.run(fetch_spec(RpcStub([SPEC, SPEC]))) == SPEC


def test_checkpoint_layout_reads_names_shapes_dtypes_from_headers(tmp_path):
    from safetensors.torch import save_file

    save_file(
        {"x": torch.zeros(2, 3), "y": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "model-1.safetensors")
    )
    save_file(
        {"z": torch.zeros(1, dtype=torch.int64)}, str(tmp_path / "model-2.safetensors"), metadata={"format": "pt"}
    )
    assert read_safetensors_layout(str(tmp_path)) == {
        "x": {"shape": [2, 3], "dtype": "float32"},
        "y": {"shape": [5], "dtype": "bfloat16"},
        "z": {"shape": [1], "dtype": "int64"},
    }


def test_checkpoint_layout_errors_name_the_folder_or_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        read_safetensors_layout(str(tmp_path))
    (tmp_path / "broken.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="broken.safetensors"):
        read_safetensors_layout(str(tmp_path))
