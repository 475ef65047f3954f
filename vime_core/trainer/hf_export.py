"""Write the trainer's weights as a Hugging Face checkpoint folder that transformers and vLLM load.

    <path>/model.safetensors     every HF tensor (TP shards gathered, vocabulary padding cut), in
                                 the source checkpoint's dtype
    <path>/config.json           the source checkpoint's config (dtype fields set to that dtype)
    <path>/tokenizer*, ...       every other non-weight file of the source folder, copied

The folder is written under a temporary name and renamed into place, so a reader sees either
the previous export or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Iterable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def source_dtype(config: dict) -> torch.dtype:
    """The dtype the source checkpoint declares (transformers 5: ``dtype``; 4: ``torch_dtype``)."""
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in DTYPES:
        raise ValueError(f"config.json dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def write_hf_folder(named_tensors: Iterable[tuple[str, torch.Tensor]], source_dir: str | Path, path: str | Path) -> Path:
    """Write ``named_tensors`` plus the source folder's config and tokenizer files to ``path``."""
    from safetensors.torch import save_file

    source, target = Path(source_dir), Path(path)
    config = json.loads((source / "config.json").read_text())
    dtype = source_dtype(config)
    tensors = {name: t.detach().to("cpu", dtype).contiguous().clone() for name, t in named_tensors}
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and item.name not in WEIGHT_INDEXES:
            shutil.copy2(item, tmp / item.name)
    dtype_name = next(k for k, v in DTYPES.items() if v == dtype)
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = dtype_name
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp, target)
    return target
