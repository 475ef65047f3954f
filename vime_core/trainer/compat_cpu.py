"""The CPU compatibility layer that lets megatron-core (0.16.1, the newest declaring Python 3.11) run
over gloo without CUDA; on a GPU machine `activate()` changes nothing. What is not shimmed: the
bf16/fp16 optimizer (on CPU the optimizer is fp32) and the default causal mask (callers always pass
one). The distributed optimizer runs (gloo has the reduce-scatter and all-gather its buffers use) for
the tests of its GPU code paths; the configuration keeps it to device=cuda."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import types
from typing import Any

import torch

log = logging.getLogger(__name__)

_ACTIVE = False
PAGED_STASH_MODULE = "megatron.core.transformer.moe.ops.paged_stash"
# Modules whose literal device="cuda" tensor factories must land on the CPU.
CUDA_LITERAL_MODULES = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (apex stand-in) returns a "cuda" tensor
)
_FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange")


def is_active() -> bool:
    """Whether the CPU shims are in force in this process."""
    return _ACTIVE


def activate() -> bool:
    """Apply the shims when CUDA is absent (idempotent). Returns True when they are in force.

    1. megatron.core.transformer.moe.ops.paged_stash imports triton unguarded in some releases: a stub
       is registered under its name when triton is absent (triton itself is never stubbed).
    2. torch.cuda.current_device() returns torch.device("cpu"), which every call site accepts.
    3. In the modules that build tensors with a literal device="cuda" (clip_grads, the FP32 optimizer,
       megatron.core.utils) the global `torch` is a proxy mapping "cuda" to "cpu".
    4. clip_grad_by_total_norm_fp32 (asserting torch.cuda.FloatTensor grads) is replaced by the same
       scaling without the assertion.
    5. Megatron's RNG tracker is created without CUDA by `seed_everything`.
    6. DistributedOptimizer, which takes only parameters whose ``type()`` is torch.cuda.*Tensor,
       sees CPU parameters under their CUDA type names while it builds its shards."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    _stub_paged_stash_without_triton()
    _redirect_current_device()
    for name in CUDA_LITERAL_MODULES:
        module = importlib.import_module(name)
        if not isinstance(module.torch, _CpuTorchProxy):
            module.torch = _CpuTorchProxy(torch)
    for name in ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer"):
        importlib.import_module(name).clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32_cpu
    _accept_cpu_params_in_distributed_optimizer()
    _ACTIVE = True
    log.info("megatron-core CPU compatibility layer active (gloo, fp32, explicit masks)")
    return True


def seed_everything(seed: int) -> None:
    """Seed torch and create Megatron's tensor-parallel RNG tracker without CUDA.

    On a GPU this also seeds the CUDA tracker the way ``model_parallel_cuda_manual_seed`` does.
    """
    # boundary: this module must import before megatron.core (the triton stub goes in first)
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        tensor_parallel.random.initialize_rng_tracker(force_reset=True)


def clip_grad_by_total_norm_fp32_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's ``clip_grad_by_total_norm_fp32`` without its CUDA type assertion."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _stub_paged_stash_without_triton() -> None:
    if _triton_available() or PAGED_STASH_MODULE in sys.modules:
        return
    try:
        spec = importlib.util.find_spec(PAGED_STASH_MODULE)
    except ModuleNotFoundError:
        spec = None
    if spec is None:
        return  # this megatron-core release has no such module
    stub = types.ModuleType(PAGED_STASH_MODULE)
    stub.__doc__ = "vime stub: the real module needs triton, which is absent (MoE paged stash)."
    sys.modules[PAGED_STASH_MODULE] = stub
    log.info("stubbed %s (triton is absent)", PAGED_STASH_MODULE)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _redirect_current_device() -> None:
    if getattr(torch.cuda.current_device, "__vime_cpu__", False):
        return
    _cpu_current_device.__vime_cpu__ = True  # type: ignore[attr-defined]
    torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CpuTorchProxy(types.ModuleType):
    """Stands in for ``torch`` inside a module: tensor factories given device "cuda" build on the
    CPU; every other attribute is torch's own."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("torch")
        self._real = real

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in _FACTORIES:
            return attr

        def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


def cuda_type_name(tensor: torch.Tensor) -> str:
    """``tensor.type()`` as it would read on a GPU: torch.FloatTensor -> torch.cuda.FloatTensor."""
    name = torch.Tensor.type(tensor)
    return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)


def _accept_cpu_params_in_distributed_optimizer() -> None:
    """Wrap DistributedOptimizer._build_model_and_main_param_groups (a staticmethod; its only type
    checks are ``param.type()`` against torch.cuda.* names) so that, during the call, each of its
    parameters answers ``type()`` with its CUDA name (an instance attribute, removed afterwards)."""
    # boundary: this module must import before megatron.core (the triton stub goes in first)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    build = DistributedOptimizer._build_model_and_main_param_groups
    if getattr(build, "__vime_cpu__", False):
        return

    def build_on_cpu(gbuf_ranges: Any, param_gbuf_map: Any, opt_group_ranges: Any, config: Any) -> Any:
        params = [p for group in opt_group_ranges for p in group["params"]]
        for p in params:
            p.type = functools.partial(cuda_type_name, p)  # Megatron calls it without arguments there
        try:
            return build(gbuf_ranges, param_gbuf_map, opt_group_ranges, config)
        finally:
            for p in params:
                del p.type

    build_on_cpu.__vime_cpu__ = True  # type: ignore[attr-defined]
    DistributedOptimizer._build_model_and_main_param_groups = staticmethod(build_on_cpu)
