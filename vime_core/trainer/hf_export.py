"""Write the trainer's weights as a Hugging Face checkpoint folder that transformers and vLLM load:
model.safetensors (TP shards gathered, padding cut, the source's dtype), the source's config.json and
its other non-weight files, at a local folder or a storage URI, published as one unit
(vime_core/storage/folders.py), so a reader sees the previous export or the new one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.folders import publish_folder, staging_dir
from vime_core.storage.fs import open_parent

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def source_dtype(config: dict) -> torch.dtype:
    """The dtype the source checkpoint declares (transformers 5: ``dtype``; 4: ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def write_hf_folder(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    source_dir: str | Path,
    path: str | Path,
    endpoint: S3Endpoint | None = None,
    label: str = "",
) -> str:
    """Write ``named_tensors`` plus the source folder's config and tokenizer files at ``path``
    (module docstring); ``endpoint``: the run's S3 server (None: this process's environment).
    Returns where the folder is: ``path``, or on an object store ``path/<label>-<random>``."""
    source = Path(source_dir)
    config = json.loads((source / "config.json").read_text())
    dtype = source_dtype(config)
    tensors = {name: t.detach().to("cpu", dtype).contiguous().clone() for name, t in named_tensors}
    location, name = open_parent(str(path), endpoint)
    tmp = staging_dir(location, name)
    try:
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name not in WEIGHT_INDEXES:
                shutil.copy2(item, tmp / item.name)
        dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
        for key in ("dtype", "torch_dtype"):
            if key in config:
                config[key] = dtype_name
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    folder = publish_folder(location, name, tmp, label)
    return str(path).rstrip("/") + folder[len(name) :]
