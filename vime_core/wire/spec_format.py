"""What an engine's model accepts, as the worker reports it (SPEC_RPC) and the trainer checks it before
any byte moves: {"source", "served_dtype", "tensors": {HF name: {"shape", "dtype"}}}, read from the
checkpoint's safetensors headers (floating tensors travel in the served dtype). Standard library only."""

from __future__ import annotations

import glob
import json
import os
import struct
from typing import Any

from vime_core.wire.layout import FLOATING

SPEC_RPC = "vime_weight_spec"  # the worker extension's method that answers with `engine_spec`

# safetensors header dtype codes -> torch dtype names
SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit


def read_safetensors_layout(model_dir: str) -> dict[str, dict[str, Any]]:
    """{name: {"shape": [...], "dtype": torch dtype name}} over every *.safetensors file in
    `model_dir`. A file starts with an 8-byte little-endian header length, then that many bytes
    of JSON mapping each tensor name to its dtype, shape and byte range."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir!r}")
    layout: dict[str, dict[str, Any]] = {}
    for path in files:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            (header_len,) = struct.unpack("<Q", raw)
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(f"{path}: header length {header_len} is not plausible; not a safetensors file?")
            header = json.loads(f.read(header_len))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            code = entry["dtype"]
            if code not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {code!r}")
            if name in layout:
                raise ValueError(f"{path}: tensor {name!r} also appears in another file of {model_dir!r}")
            layout[name] = {"shape": list(entry["shape"]), "dtype": SAFETENSORS_DTYPES[code]}
    return layout


def engine_spec(model_dir: str, served_dtype: str) -> dict[str, Any]:
    """The spec (module docstring) of a server that started from `model_dir` and serves
    `served_dtype`."""
    tensors = read_safetensors_layout(model_dir)
    for entry in tensors.values():
        if entry["dtype"] in FLOATING:
            entry["dtype"] = served_dtype
    return {"source": model_dir, "served_dtype": served_dtype, "tensors": tensors}
