"""The weight-update session vime's vLLM backends share (`vime_shm`, `vime_broadcast`): vLLM's
checkpoint-format reload, each bucket's tensors viewed in the received bytes and loaded through the
model's own `load_weights` (which fuses and shards for TP). vLLM keeps views until a layer is complete,
so a backend holds what it received until `finish`. A bucket that comes with checksums is checked
against them before any of it loads (wire/checksum.py). Imports only vllm, torch, the standard
library, vime_core/wire and vime_core/utils/timing.py (itself standard library only)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from vime_core.utils.timing import timed
from vime_core.wire.checksum import mismatched

try:  # the CPU build's vLLM (0.32); 0.26, the GPU hosts' release, has neither the check nor this module
    from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
except ImportError:
    disable_mtp_completeness_check = None

try:  # the CPU build's vLLM (0.32): its CPU MoE experts; 0.26, the GPU hosts' release, has no such module
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
except ImportError:
    CPUUnquantizedExperts = None


@dataclass
class UpdateStats:
    """Where a worker's time went during the last (or current) weight-update session."""

    buckets: int = 0
    bytes: int = 0
    map_seconds: float = 0.0  # getting the bytes: mapping the shm file, receiving the broadcast
    check_seconds: float = 0.0  # the received bytes' checksums against the sender's
    checked_tensors: int = 0
    load_seconds: float = 0.0
    finish_seconds: float = 0.0
    loaded_names: set[str] = field(default_factory=set)

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": self.buckets,
            "bytes": self.bytes,
            "map_seconds": self.map_seconds,
            "check_seconds": self.check_seconds,
            "checked_tensors": self.checked_tensors,
            "load_seconds": self.load_seconds,
            "finish_seconds": self.finish_seconds,
            "loaded_tensors": len(self.loaded_names),
        }


def refresh_tied_layers(model: torch.nn.Module) -> list[str]:
    """Re-run weight post-processing of layers whose weight is tied to another layer's.

    Why: on CPU, linear-like layers keep a pre-packed copy of their weight for the GEMM kernels
    (`dispatch_cpu_unquantized_gemm`, built in `process_weights_after_loading`). A tied
    `lm_head` receives no tensor of its own during a reload, so vLLM's layerwise reload puts its
    (shared, updated) weight back without re-packing, and logits keep using the old embedding.
    Seen with vLLM CPU 0.32.0 for both the weight-update session and `reload_weights`.
    Returns the names of the layers refreshed.
    """
    owners: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        if weight is not None:
            owners.setdefault(id(weight), []).append((name, module))
    refreshed = []
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for name, module in modules:
            quant_method = getattr(module, "quant_method", None)
            if quant_method is not None and hasattr(quant_method, "process_weights_after_loading"):
                quant_method.process_weights_after_loading(module)
                refreshed.append(name)
    return refreshed


def repack_cpu_experts_on_reload(model: torch.nn.Module) -> int:
    """Make every later reload of ``model``'s CPU MoE layers re-pack their expert weights; how many
    layers (idempotent: a layer already made so is not counted again).

    Why: on the first load vLLM's unquantized MoE method (``_setup_kernel``) builds its kernel and
    lets the CPU experts (``CPUUnquantizedExperts.process_weights_after_loading``) pad the
    intermediate dimension and pre-pack w13/w2 into the grouped-GEMM layout, same shape, other
    element order. On a reload it only copies the checkpoint-layout weights into the parameters
    and skips that step (vLLM CPU 0.32.0), so the kernel reads unpacked weights as packed ones:
    even an unchanged publish moves the served log-probs. The wrapper runs the experts' step
    after the method's own whenever the kernel already exists (a reload), on the layer vLLM's
    layerwise reload processes, before it copies the result into the served tensors."""
    if CPUUnquantizedExperts is None:
        return 0
    wrapped = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_vime_repacks", False):
            continue
        method.process_weights_after_loading = functools.partial(
            _process_and_repack, method.process_weights_after_loading, method
        )
        method._vime_repacks = True
        wrapped += 1
    return wrapped


def _process_and_repack(process: Callable[[torch.nn.Module], None], method: Any, layer: torch.nn.Module) -> None:
    reloading = method.moe_kernel is not None
    process(layer)
    if reloading:
        method.moe_kernel.fused_experts.process_weights_after_loading(layer)


def _no_mtp_completeness_check() -> contextlib.AbstractContextManager:
    """The CPU build's vLLM (0.32) checks that a load brought a model's MTP weights too, which one
    bucket of an update never does (its own backends switch the check off the same way); 0.26,
    the GPU hosts' release, has neither the check nor its module."""
    if disable_mtp_completeness_check is None:
        return contextlib.nullcontext()
    return disable_mtp_completeness_check()


class LayerwiseReloadEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """A backend implements `init_transfer_engine`, `receive_weights` (receive, then `load`) and
    `release_received`; the session around them is here."""

    supports_draft_weight_update = True

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.stats = UpdateStats()
        self._reloading = False  # the model's layers are in layerwise-reload mode

    def start_weight_update(self) -> None:
        if self._reloading:  # a session nobody finished: end its reload first (`update_weights`)
            self._end_reload()
        self.release_received()
        self.stats = UpdateStats()
        repack_cpu_experts_on_reload(self.model)
        initialize_layerwise_reload(self.model)
        self._reloading = True

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.receive_weights(self.parse_update_info(update_info))
        except BaseException as failed:
            # vLLM's worker ends the session when a bucket fails without finishing it (0.32), which
            # leaves the layers in reload mode, where the next session's load fails: end the reload
            # here, keeping what loaded (the trainer's PublishError says the update is half-applied
            # and its next publish sends every tensor)
            try:
                self._end_reload()
            except Exception as ending:  # the bucket's own error is the one to report
                failed.add_note(f"ending the weight reload after it failed as well: {ending}")
            raise
        # The base class synchronizes the accelerator after each bucket, which raises on a
        # CPU-only torch; so only sync when there is one.
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def load(
        self,
        weights: list[tuple[str, torch.Tensor]],
        nbytes: int,
        receive_seconds: float,
        checksums: list[int] | None = None,
    ) -> None:
        """Load one received bucket's (name, tensor) views into the model; count it. With the
        sender's `checksums`, a bucket whose bytes differ from what was sent is refused whole
        (ValueError naming the tensors) before any of it loads."""
        if checksums is not None:
            with timed() as checking:
                bad = mismatched(weights, checksums)
            self.stats.check_seconds += checking.seconds
            if bad:
                raise ValueError(
                    f"{len(bad)} of {len(weights)} tensors of this bucket arrived other than they were sent "
                    f"(checksum): {', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''}; none of it was loaded"
                )
            self.stats.checked_tensors += len(weights)
        with timed() as loading, _no_mtp_completeness_check():
            self.model.load_weights(weights)
        self.stats.buckets += 1
        self.stats.bytes += nbytes
        self.stats.map_seconds += receive_seconds
        self.stats.load_seconds += loading.seconds
        self.stats.loaded_names.update(name for name, _ in weights)

    def finish_weight_update(self) -> None:
        with timed() as finishing:
            self._end_reload()
        self.stats.finish_seconds = finishing.seconds

    def _end_reload(self) -> None:
        """Process what the session loaded and put every layer back in serving mode (a layer
        that received nothing gets its previous tensors back), then drop the received buffers."""
        try:
            if self._reloading:
                with torch.no_grad():
                    finalize_layerwise_reload(self.model, self.model_config)
                    refresh_tied_layers(self.model)
        finally:
            self._reloading = False
            self.release_received()

    def release_received(self) -> None:
        """Give back what the received buckets hold (vLLM's views of them are gone after finish)."""

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:  # abstract on vLLM 0.26
        raise NotImplementedError("vime's backends are driven by vime's trainer (vime_core/weight_sync/transport/)")
