"""The worker-side capture's bookkeeping without an engine: vime's request id from vLLM's, rows
written by position (a preempted request forwarded again from 0 replaces its rows), vLLM's .npy
encoding read back."""

from __future__ import annotations

import base64
import io

import numpy as np

from vime_core.engines.vllm_side.routing_capture import _Rows, encode_rows, external_id


def test_external_id_undoes_vllms_prefix_and_random_suffix():
    assert external_id("generate-tokens-abc123-1a2b3c4d") == "abc123"
    assert external_id("generate-tokens-abc123") == "abc123"  # request-id randomisation off


def test_rows_by_position_and_a_restart():
    rng = np.random.default_rng(0)
    rows = _Rows((2, 3), np.dtype(np.uint8))
    chunks = [rng.integers(0, 8, (n, 2, 3), dtype=np.uint8) for n in (5, 1, 1)]
    start = 0
    for chunk in chunks:
        rows.write(start, chunk)
        start += len(chunk)
    np.testing.assert_array_equal(rows.data[: rows.count], np.concatenate(chunks))
    assert rows.nbytes == 7 * 2 * 3
    again = rng.integers(0, 8, (4, 2, 3), dtype=np.uint8)
    rows.write(0, again)  # preempted, recomputed from its first token
    assert rows.count == 4
    np.testing.assert_array_equal(rows.data[: rows.count], again)


def test_encoding_is_numpys_own():
    rows = np.arange(24, dtype=np.uint16).reshape(2, 3, 4)
    back = np.load(io.BytesIO(base64.b64decode(encode_rows(rows))), allow_pickle=False)
    assert back.dtype == np.uint16 and np.array_equal(back, rows)
