"""What a trainer call that ran out of device memory tells the user: which call, the allocator's
own figures, and the settings that decide that call's memory, so the error names what to change
(`TrainerActor.call` raises it as TrainerOutOfMemoryError; the run stops with it, not retried)."""

from __future__ import annotations

from vime_core.utils.errors import TrainerOutOfMemoryError

_ENGINES = (
    "the engines' KV cache when they share the device (vllm_gpu_memory_utilization, or "
    "--kv-cache-memory in vllm_extra_args)"
)
_STEP = "max_tokens_per_gpu (a micro-batch's tokens), recompute_granularity=full"
# the settings that decide each trainer call's device memory, most likely first
SETTINGS_BY_CALL: dict[str, str] = {
    "train": f"{_STEP}, use_distributed_optimizer",
    "compute_log_probs": _STEP,
    "publish": f"update_weight_buffer_size (the bytes sent at a time), {_ENGINES}",
    "init": f"the model's size against the device, tensor_model_parallel_size, {_ENGINES}",
}
_ANY_CALL = f"{_STEP}, update_weight_buffer_size, {_ENGINES}"
# torch's message goes on with advice about its allocator's own settings after these
_ALLOCATOR_ADVICE = (" If reserved but unallocated", " See documentation")


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (by name: the caller need not import torch)."""
    return any(cls.__name__ == "OutOfMemoryError" and cls.__module__.startswith("torch") for cls in type(exc).__mro__)


def out_of_memory_error(method: str, exc: BaseException) -> TrainerOutOfMemoryError:
    """One line: `trainer <method> ran out of device memory; settings that decide its memory:
    <settings> (<torch's figures>)`."""
    figures = " ".join(str(exc).split())
    for advice in _ALLOCATOR_ADVICE:
        figures = figures.split(advice)[0]
    settings = SETTINGS_BY_CALL.get(method, _ANY_CALL)
    return TrainerOutOfMemoryError(
        f"trainer {method} ran out of device memory; settings that decide its memory: {settings} ({figures.strip()})"
    )
