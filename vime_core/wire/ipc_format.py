"""The CUDA IPC wire format: what vLLM's own `ipc` weight-transfer backend reads from a packed bucket's
`update_info`, and how GPUs are keyed in it (`gpu_uuid`, on both ends). One uint8 buffer per GPU,
tensors back to back (`layout.place` with alignment 1); the payload carries names, dtypes, shapes,
sizes and the pickled handles. Standard library only at import (torch inside `gpu_uuid`)."""

from __future__ import annotations

import base64
import pickle
from typing import Any

DEVICE_UUID_RPC = "vime_device_uuid"  # the worker extension's method that answers with its `gpu_uuid`


def gpu_uuid(index: int) -> str:
    """CUDA device `index`'s UUID, the key of its handle in `ipc_handles_pickled`."""
    import torch  # boundary: the wire formats load without torch (wire/__init__.py)

    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_update_info(
    bucket: Any, sizes: list[int], handle: dict[str, tuple], packed_flag: bool = False
) -> dict[str, Any]:
    """The `update_info` vLLM's `IPCWeightTransferUpdateInfo` accepts over HTTP (packed) for
    `bucket` (its `names`, `dtype_names` and `tensors`: vime_core/weight_sync/buckets.Bucket),
    `sizes` its tensors' bytes and `handle` {GPU UUID: handle args}; `packed_flag` adds
    `"packed": true` (vLLM 0.26 reads it there)."""
    info = {
        "names": list(bucket.names),
        "dtype_names": bucket.dtype_names,
        "shapes": [list(t.shape) for t in bucket.tensors],
        "tensor_sizes": sizes,
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handle)).decode("ascii"),
    }
    if packed_flag:
        info["packed"] = True
    return info
