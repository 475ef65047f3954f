"""The CUDA IPC wire format: what vLLM's own `ipc` weight-transfer backend reads from a packed
bucket's `update_info` (`IPCWeightTransferUpdateInfo`, over HTTP), and how GPUs are named in it.

    buffer   one uint8 CUDA tensor per GPU; tensor i (in its wire dtype) at byte
             sum(tensor_sizes[:i]), no padding (`layout.place` with alignment 1); vLLM splits
             the buffer by `tensor_sizes`
    payload  {"names", "dtype_names", "shapes", "tensor_sizes",
              "ipc_handles_pickled": base64(pickle({gpu_uuid: reduce_tensor(buffer)[1], ...})),
              "packed": true (vLLM 0.26 only; later releases take it in `init_weight_transfer`)}

Each engine worker opens the handle of its own GPU, keyed by `gpu_uuid` on both ends: the
trainer when it packs (`vime_core/weight_sync/transport/ipc.py`), the worker extension when the
trainer asks where its workers run (`DEVICE_UUID_RPC`). The server needs
`VLLM_ALLOW_INSECURE_SERIALIZATION=1` to unpickle the handles.

Standard library only at import (torch inside `gpu_uuid`).
"""

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
