"""vLLM worker extension (`--worker-extension-cls ...worker_ext.VimeWorkerExtension`): importing it
registers vime's weight-transfer backends (`vime_shm`, `vime_broadcast`), and the class adds the
`vime_*` methods the trainer calls through `POST /collective_rpc` (names and formats: vime_core/wire/).
Runs inside the vLLM worker: imports only vllm, torch, the standard library and vime_core.wire."""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

from vime_core.engines.vllm_side.reload_session import refresh_tied_layers, repack_cpu_experts_on_reload
from vime_core.engines.vllm_side.routing_capture import RoutingCapture, native_routing_capture
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
        """vLLM's `reload_weights(weights_path=...)` plus the MoE expert re-pack and the tied-layer
        refresh it lacks on CPU (see `reload_session`)."""
        repack_cpu_experts_on_reload(self.get_model())  # type: ignore[attr-defined]
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

    def vime_arm_routing_capture(self) -> dict[str, Any]:
        """Capture routed experts from now on (once per worker; vllm_side/routing_capture.py): the layout
        and the capture's cost so far, or {"native": True} when vLLM itself returns them
        (`--enable-return-routed-experts`)."""
        if native_routing_capture(self.vllm_config):  # type: ignore[attr-defined]
            return {"native": True}
        capture = getattr(self, "_vime_routing_capture", None)
        if capture is None:
            capture = RoutingCapture(self)
            capture.arm()
            self._vime_routing_capture = capture
        return capture.layout()

    def vime_take_routed_experts(
        self, request_ids: list[str], prompt_starts: list[int], all_ranks: bool = False
    ) -> dict[str, Any]:
        """Each request's captured rows from its prompt_start on (`RoutingCapture.take`), or None. TP
        ranks route the same tokens alike (the gate is replicated): rank 0 answers with the rows, the
        others drop theirs and answer None, so a take moves one copy; `all_ranks`: every rank answers."""
        capture = getattr(self, "_vime_routing_capture", None)
        if capture is None:
            return dict.fromkeys(request_ids)
        answers = all_ranks or get_tensor_model_parallel_rank() == 0
        return capture.take(request_ids, prompt_starts, encode=answers)
