"""Elementwise math through torch.compile on CUDA, eagerly elsewhere: the trainer's memory-bound pieces
(the response head's chunk math, RoPE) become one or two fused kernels each way on a GPU, and run the
same math eagerly on the CPU."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

log = logging.getLogger(__name__)

_compiled: dict[str, Optional[Callable[..., Any]]] = {}  # qualified name -> compiled function; None: failed


def run_compiled(fn: Callable[..., Any], x: torch.Tensor, *args: Any, enabled: bool = True) -> Any:
    """``fn(x, *args)``: through ``torch.compile`` (dynamic shapes) when ``enabled`` and ``x`` is
    on CUDA; eagerly otherwise, or once compiling ``fn`` has failed (warned once; the eager
    function computes the same)."""
    if not _wanted(x, enabled):
        return fn(x, *args)
    name = f"{fn.__module__}.{fn.__qualname__}"
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, dynamic=True)
    compiled = _compiled[name]
    if compiled is None:
        return fn(x, *args)
    try:
        return compiled(x, *args)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # a compiler failure: run eagerly from now on
        log.warning("torch.compile of %s failed (%s: %s); running it eagerly", name, type(err).__name__, err)
        _compiled[name] = None
        return fn(x, *args)


def _wanted(x: torch.Tensor, enabled: bool) -> bool:
    return enabled and x.is_cuda
