"""A sample's routed experts: the expert ids the engine routed each forwarded token to, as one
.npy array [rows, engine layers, top_k] of uint8 (uint16 above 256 experts), row t = token t of
`tokens` (every layer the engine has, dense ones 0). The last token is never forwarded, so
rows <= len(tokens) - 1. Stored as `np.save` bytes (the shape and dtype travel with the rows;
read back with pickles refused)."""

from __future__ import annotations

import io
from typing import Optional

import numpy as np

DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))


class RoutedExpertsError(ValueError):
    """Rows that are not a routed-experts array, or do not fit the sample."""


def encode(rows: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(rows), allow_pickle=False)
    return buffer.getvalue()


def decode(data: bytes) -> np.ndarray:
    """The [rows, layers, top_k] array of `data`; RoutedExpertsError for anything else."""
    try:
        rows = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise RoutedExpertsError(f"routed_experts is not a .npy array: {exc}") from None
    if rows.ndim != 3 or rows.dtype not in DTYPES:
        raise RoutedExpertsError(
            f"routed_experts has shape {rows.shape} and dtype {rows.dtype}; expected [rows, layers, top_k] uint8/uint16"
        )
    return rows


def appended(data: Optional[bytes], rows: np.ndarray, start: int, total_length: int) -> bytes:
    """`data`'s rows followed by `rows`, which begin at token `start` (the request's
    routed_experts_prompt_start: the rows held so far); refused when the layout differs, `start`
    is not where the held rows end, or the rows would pass token total_length - 2."""
    held = decode(data) if data is not None else rows[:0]
    if held.shape[1:] != rows.shape[1:] or held.dtype != rows.dtype:
        raise RoutedExpertsError(
            f"routed_experts rows of shape {rows.shape[1:]} {rows.dtype} after rows of {held.shape[1:]} {held.dtype}"
        )
    if start != held.shape[0]:
        raise RoutedExpertsError(f"routed_experts rows start at token {start}, the sample holds {held.shape[0]}")
    if held.shape[0] + rows.shape[0] > total_length - 1:
        raise RoutedExpertsError(
            f"{held.shape[0] + rows.shape[0]} routed_experts rows for {total_length} tokens (at most one per token "
            "but the last)"
        )
    return encode(np.concatenate([held, rows]))
