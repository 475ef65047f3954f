"""Routed-experts capture inside a vLLM worker, for engines whose release cannot capture natively
(vLLM 0.32 on CPU: its `--enable-return-routed-experts` needs Model Runner V2, which needs Triton).

Each MoE layer's router calls a hook with the logical top-k expert ids of the step's tokens
(`BaseRouter.set_capture_fn`, the hook vLLM's own capturer uses); after the model runner's
`execute_model` the step's rows go to their requests by position (the runner's input batch order,
`num_scheduled_tokens` each, positions from the runner). A request's rows are those of every
forwarded position 0..n-1 (the last sampled token is never forwarded), in vLLM's native layout:
[rows, hidden layers, top_k] uint8 (uint16 above 256 experts), dense layers' rows 0.
The router hook is read when the forward runs, so the engine must run eagerly (a compiled graph
never calls it), and without prefix caching (cached prompt tokens are not forwarded).
Each TP rank runs the replicated router on the same tokens, so each captures the same rows; a take
hands out rank 0's (worker_ext.vime_take_routed_experts) and the other ranks drop theirs."""

from __future__ import annotations

import base64
import io
import time
from collections import OrderedDict
from functools import partial
from typing import Any, Optional

import numpy as np
import torch

# vime's /inference/v1/generate request id R becomes "generate-tokens-R-<8 hex>" inside vLLM
# (token_in_token_out/serving.py and the input processor's randomisation)
GENERATE_PREFIX = "generate-tokens-"
# finished requests kept for a take; the oldest go first beyond this (aborted requests are never taken)
DEFAULT_MAX_KEPT_BYTES = 512 * 2**20


def external_id(internal: str) -> str:
    """vime's request id of vLLM's internal one ("generate-tokens-R-1a2b3c4d" -> "R")."""
    stem, sep, suffix = internal.rpartition("-")
    if sep and len(suffix) == 8:
        internal = stem
    return internal.removeprefix(GENERATE_PREFIX)


def native_routing_capture(config: Any) -> bool:
    """vLLM returns routed experts itself: `--enable-return-routed-experts` (0.26 keeps the switch on
    the model config, 0.32 on the aux-output config)."""
    holders = (getattr(config, "aux_output_config", None), config.model_config)
    return any(bool(getattr(h, "enable_return_routed_experts", False)) for h in holders if h is not None)


def encode_rows(rows: np.ndarray) -> str:
    """base64 of `np.save` bytes (allow_pickle off): vLLM's own `routed_experts` encoding."""
    buffer = io.BytesIO()
    np.save(buffer, rows, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _Rows:
    """One request's rows, written by position (a preempted request is forwarded again from 0)."""

    def __init__(self, per_token: tuple[int, int], dtype: np.dtype) -> None:
        self.data = np.zeros((0, *per_token), dtype=dtype)
        self.count = 0

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + rows.shape[0]
        if end > self.data.shape[0]:
            grown = np.zeros((max(end, 2 * self.data.shape[0]), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[: self.count] = self.data[: self.count]
            self.data = grown
        self.data[start:end] = rows
        self.count = end  # a restart at `start` drops what came after it

    @property
    def nbytes(self) -> int:
        return self.count * self.data[0].nbytes if self.data.shape[0] else 0


class RoutingCapture:
    """The worker's capture: `arm` binds the router hooks and wraps `execute_model`; `take` hands a
    request's rows out once."""

    def __init__(self, worker: Any, max_kept_bytes: int = DEFAULT_MAX_KEPT_BYTES) -> None:
        config = worker.vllm_config
        model_config = config.model_config
        self.layers = model_config.get_total_num_hidden_layers()
        self.top_k = model_config.get_num_experts_per_tok()
        num_experts = model_config.get_num_experts()
        if num_experts <= 0 or self.top_k <= 0:
            raise ValueError(f"routing capture: {model_config.model} is not a mixture-of-experts model")
        self.dtype = np.dtype(np.uint8 if num_experts <= 256 else np.uint16)
        self._check_config(config)
        self.runner = worker.model_runner
        self.max_kept_bytes = max_kept_bytes
        self._step: dict[int, torch.Tensor] = {}
        self._live: dict[str, _Rows] = {}
        self._done: OrderedDict[str, _Rows] = OrderedDict()
        self._kept_bytes = 0
        self.error: Optional[str] = None
        self.steps = 0
        self.capture_s = self.step_s = 0.0

    @staticmethod
    def _check_config(config: Any) -> None:
        from vllm.config import CompilationMode  # boundary: vLLM's worker process only

        if config.compilation_config.mode != CompilationMode.NONE:
            raise ValueError(
                "routing capture: the engine compiles its forward (torch.compile), which never calls the router "
                "hook; start it with --enforce-eager (vllm_enforce_eager=true)"
            )
        if config.cache_config.enable_prefix_caching:
            raise ValueError(
                "routing capture: prefix caching is on (cached prompt tokens are not forwarded, so not captured); "
                "start the engine with --no-enable-prefix-caching"
            )
        if config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("routing capture: pipeline parallelism > 1 (each stage routes its own layers)")

    def layout(self) -> dict[str, Any]:
        """The rows' layout, and what capturing cost so far: seconds in the hooks and the filing
        (`capture_s`) against the seconds of the steps they ran in (`step_s`, hooks included)."""
        return {
            "layers": self.layers,
            "top_k": self.top_k,
            "dtype": self.dtype.name,
            "steps": self.steps,
            "capture_s": self.capture_s,
            "step_s": self.step_s,
        }

    def arm(self) -> int:
        """Bind the hook on every MoE layer's router; returns how many layers."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner  # boundary: vLLM's worker only
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        bound = 0
        for module in self.runner.get_model().modules():
            if not isinstance(module, MoERunner):
                continue
            if not isinstance(module.router, BaseRouter):
                raise ValueError(f"routing capture: router {type(module.router).__name__} takes no capture hook")
            module.router.set_capture_fn(partial(self._capture, module.layer_id))
            bound += 1
        if not bound:
            raise ValueError("routing capture: the served model has no MoE layer")
        execute = self.runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            self._step = {}
            began = time.perf_counter()
            out = execute(scheduler_output, *args, **kwargs)
            filing = time.perf_counter()
            self._record(scheduler_output)
            done = time.perf_counter()
            self.capture_s += done - filing
            self.step_s += done - began
            return out

        self.runner.execute_model = execute_model
        return bound

    def _capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        began = time.perf_counter()
        self._step[layer_id] = topk_ids.detach().to("cpu", copy=True)
        self.capture_s += time.perf_counter() - began

    def _record(self, scheduler_output: Any) -> None:
        for internal in scheduler_output.finished_req_ids:
            rows = self._live.pop(external_id(internal), None)
            if rows is not None:
                self._keep(external_id(internal), rows)
        total = int(scheduler_output.total_num_scheduled_tokens)
        if total == 0:
            return
        if not self._step:
            self.error = (
                f"routing capture: a step of {total} tokens called no router hook (a compiled forward, or "
                "capture armed after compilation)"
            )
            return
        self.steps += 1
        rows = np.zeros((total, self.layers, self.top_k), dtype=self.dtype)
        for layer_id, ids in self._step.items():
            rows[:, layer_id] = ids[:total].numpy()
        positions = self.runner.positions[:total].to("cpu").numpy()
        batch = self.runner.input_batch
        offset = 0
        for internal in batch.req_ids[: batch.num_reqs]:
            count = int(scheduler_output.num_scheduled_tokens.get(internal, 0))
            if not count:
                continue
            key = external_id(internal)
            stored = self._live.get(key)
            if stored is None:
                stored = self._live[key] = _Rows((self.layers, self.top_k), self.dtype)
            start = int(positions[offset])
            if start > stored.count:
                self.error = (
                    f"routing capture: request {key} starts at position {start} with {stored.count} rows "
                    "(a prefix-cache hit skipped the forward of its first tokens)"
                )
            stored.write(start, rows[offset : offset + count])
            offset += count

    def _keep(self, key: str, rows: _Rows) -> None:
        self._done[key] = rows
        self._kept_bytes += rows.nbytes
        while self._kept_bytes > self.max_kept_bytes and len(self._done) > 1:
            _, old = self._done.popitem(last=False)
            self._kept_bytes -= old.nbytes

    def take(self, request_ids: list[str], prompt_starts: list[int], encode: bool = True) -> dict[str, Optional[str]]:
        """{request id: base64 .npy of rows[prompt_start:] ([n, layers, top_k]), or None when this
        worker holds no rows for it, or ``encode`` is off}; each request's rows leave the worker."""
        if self.error is not None:
            raise RuntimeError(self.error)
        out: dict[str, Optional[str]] = {}
        for request_id, start in zip(request_ids, prompt_starts, strict=True):
            rows = self._done.pop(request_id, None)
            if rows is not None:
                self._kept_bytes -= rows.nbytes
            else:
                rows = self._live.pop(request_id, None)
            if rows is None:
                out[request_id] = None
                continue
            if not 0 <= start <= rows.count:
                raise ValueError(f"routing capture: prompt_start={start} outside the {rows.count} rows of {request_id}")
            out[request_id] = encode_rows(rows.data[start : rows.count]) if encode else None
        return out
