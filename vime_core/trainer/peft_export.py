"""Export a LoRA adapter as a PEFT adapter folder (`vime_core/models/peft_adapter.py`: the files,
and what `peft.PeftModel.from_pretrained` reads in them) at a local folder or a storage URI,
published as one unit as the HF export is (`hf_export`): renamed into place on a local disk, on
an object store uploaded under a fresh prefix that a manifest written last names.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vime_core.models.peft_adapter import write_adapter_files
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.folders import publish_folder, staging_dir
from vime_core.storage.fs import open_parent


def write_peft_folder(
    adapter: Mapping[str, torch.Tensor],
    settings: Mapping[str, Any],
    base_model: str,
    path: str | Path,
    dtype: torch.dtype | None = None,
    endpoint: S3Endpoint | None = None,
    label: str = "",
) -> str:
    """The PEFT folder at `path` (module docstring), published as one unit; `base_model`: the
    base checkpoint's folder or hub id, recorded for PEFT. Returns where the folder is: `path`,
    or on an object store `path/<label>-<random>` (as `hf_export.write_hf_folder`)."""
    location, name = open_parent(str(path), endpoint)
    tmp = staging_dir(location, name)
    try:
        write_adapter_files(adapter, settings, base_model, tmp, dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    folder = publish_folder(location, name, tmp, label)
    return str(path).rstrip("/") + folder[len(name) :]
