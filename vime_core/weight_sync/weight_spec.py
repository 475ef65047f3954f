"""What an engine's model accepts, and the check of a publish against it before any byte moves: a vLLM
server whose update fails half-way keeps a half-loaded model. The spec comes from the worker
extension (`vime_weight_spec`, format wire/spec_format.py), read once from the server's checkpoint."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vime_core.wire.spec_format import SPEC_RPC

if TYPE_CHECKING:
    from vime_core.engines.client import EngineClient

_SHOW = 5  # names quoted in an error message


class WeightSpecError(ValueError):
    """The tensors to publish do not fit an engine's model."""


async def fetch_spec(engine: "EngineClient") -> dict[str, Any]:
    """The engine's {"tensors": {name: {"shape", "dtype"}}, "served_dtype", "source"}; every worker
    (TP rank) must agree."""
    results = await engine.collective_rpc(SPEC_RPC)
    if not results or not isinstance(results[0], dict) or "tensors" not in results[0]:
        raise WeightSpecError(
            f"engine {engine.name}: {SPEC_RPC} returned {str(results)[:200]!r}; was the server started with "
            "--worker-extension-cls vime_core.engines.vllm_side.worker_ext.VimeWorkerExtension?"
        )
    if any(r != results[0] for r in results[1:]):
        raise WeightSpecError(f"engine {engine.name}: its workers disagree on the model's weights")
    return results[0]


def check_against_spec(
    named_tensors: Sequence[tuple[str, torch.Tensor]], spec: dict[str, Any], engine: str
) -> dict[str, torch.dtype]:
    """Raise `WeightSpecError` naming the tensor and engine when a name is duplicated, unknown or
    missing, a shape differs, or a dtype cannot be sent as the engine's; else return each
    tensor's wire dtype (floating tensors travel in the engine's served dtype)."""
    expected: dict[str, dict[str, Any]] = spec["tensors"]
    seen: set[str] = set()
    wire: dict[str, torch.dtype] = {}
    for name, tensor in named_tensors:
        if name in seen:
            raise WeightSpecError(f"publish to engine {engine}: tensor {name!r} appears twice")
        seen.add(name)
        if name not in expected:
            raise WeightSpecError(
                f"publish to engine {engine}: unknown tensor {name!r}; the model has no such weight "
                f"(it expects e.g. {sorted(expected)[:_SHOW]})"
            )
        want = expected[name]
        if list(tensor.shape) != list(want["shape"]):
            raise WeightSpecError(
                f"publish to engine {engine}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"the model expects {list(want['shape'])}"
            )
        want_dtype = getattr(torch, want["dtype"])
        if tensor.dtype != want_dtype and not (tensor.dtype.is_floating_point and want_dtype.is_floating_point):
            raise WeightSpecError(
                f"publish to engine {engine}: tensor {name!r} has dtype {tensor.dtype}, the model expects {want_dtype}"
            )
        wire[name] = want_dtype
    missing = sorted(set(expected) - seen)
    if missing:
        raise WeightSpecError(
            f"publish to engine {engine}: {len(missing)} tensor(s) missing, e.g. {missing[:_SHOW]}; "
            "a weight update must carry every weight of the model"
        )
    return wire
