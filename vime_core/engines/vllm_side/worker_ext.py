"""vLLM worker extension loaded with `--worker-extension-cls
vime_core.engines.vllm_side.worker_ext.VimeWorkerExtension`.

Importing this module (vLLM does it in every worker before the model loads) registers vime's
weight-transfer backends, `vime_shm` (CPU engines on the trainer's machine) and `vime_broadcast`
(engines elsewhere, over NCCL or gloo), for `--weight-transfer-config '{"backend": ...}'`. The
class adds methods callable through `POST /collective_rpc`:

- `vime_weight_spec()`: the HF-named tensors the model's `load_weights` expects (name, shape,
  dtype on the wire), read from the checkpoint the server started from. The trainer validates a
  publish against it before any byte moves, because a half-applied update breaks the server.
- `vime_reload_weights(weights_path)`: vLLM's disk reload, fixed for tied embeddings on CPU.
- `vime_update_stats()`: where this worker's time went in the last `vime_shm` or `vime_broadcast` session.
- `vime_device_uuid()`: this worker's GPU, as CUDA IPC handles are keyed (the trainer checks
  that every worker's GPU has a handle before the first bucket moves).
- `vime_broadcast_group_id()`: the `vime_broadcast` group this worker is in; one answer per
  worker, so the trainer also learns how many workers an engine has.
- `vime_weight_version()` / `vime_set_weight_version(version)`: the weight version on releases
  whose server keeps none (vLLM 0.26, see `vime_core/engines/vllm_api.py`); a restarted engine
  reports None (the checkpoint's weights, version 0), as `/weight_info` would.

The RPC names and the formats they answer in are shared with the trainer:
`vime_core/wire/` (`spec_format.SPEC_RPC`, `ipc_format.DEVICE_UUID_RPC`,
`broadcast_format.GROUP_ID_RPC`).

Runs inside the vLLM worker: imports only vllm, torch, the standard library and the shared wire
formats (`vime_core.wire`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

from vime_core.engines.vllm_side.reload_session import refresh_tied_layers
from vime_core.wire.broadcast_format import BACKEND_NAME as BROADCAST_BACKEND
from vime_core.wire.ipc_format import gpu_uuid
from vime_core.wire.shm_format import BACKEND_NAME
from vime_core.wire.spec_format import engine_spec


BACKENDS = {  # name -> (module, class), registered with vLLM when a worker imports this module
    BACKEND_NAME: ("vime_core.engines.vllm_side.shm_backend", "ShmWeightTransferEngine"),
    BROADCAST_BACKEND: ("vime_core.engines.vllm_side.broadcast_backend", "BroadcastWeightTransferEngine"),
}


def _register_backends() -> None:
    for name, (module, cls) in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, cls)
        except ValueError:  # already registered (module imported twice in one process)
            pass


_register_backends()


class VimeWorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`; `self` is the worker."""

    def vime_weight_spec(self) -> dict[str, Any]:
        """What a full weight update must contain. Floating tensors travel in the served dtype
        (the model's parameters' dtype); others in the checkpoint's. Cached on first call: a
        disk reload repoints `model_config.model` at a folder that may be gone later."""
        cached = getattr(self, "_vime_weight_spec", None)
        if cached is not None:
            return cached
        model_config = self.vllm_config.model_config  # type: ignore[attr-defined]
        source = model_config.model
        if not os.path.isdir(source):
            raise FileNotFoundError(f"vime_weight_spec needs a local checkpoint folder; model is {source!r}")
        spec = engine_spec(source, str(model_config.dtype).removeprefix("torch."))
        self._vime_weight_spec = spec
        return spec

    def vime_reload_weights(self, weights_path: str) -> None:
        """vLLM's `reload_weights(weights_path=...)` plus the tied-layer refresh it lacks on CPU
        (see `reload_session.refresh_tied_layers`)."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        with torch.no_grad():
            refresh_tied_layers(self.get_model())  # type: ignore[attr-defined]

    def vime_update_stats(self) -> dict[str, Any]:
        engine = getattr(self, "weight_transfer_engine", None)
        stats = getattr(engine, "stats", None)
        return stats.as_dict() if stats is not None else {}

    def vime_device_uuid(self) -> str | None:
        """This worker's GPU as the trainer names it in CUDA IPC handles (None without CUDA)."""
        if not torch.cuda.is_available():
            return None
        return gpu_uuid(torch.cuda.current_device())

    def vime_broadcast_group_id(self) -> str | None:
        """The `vime_broadcast` group this worker is in (None: none, or another backend)."""
        return getattr(getattr(self, "weight_transfer_engine", None), "group_id", None)

    def vime_weight_version(self) -> Any:
        return getattr(self, "_vime_weight_version", None)

    def vime_set_weight_version(self, version: str) -> None:
        self._vime_weight_version = str(version)
