"""The trainer checkpoint on disk.

    <storage>/checkpoints/<run>/rollout_<k:06d>/
        rank_<r>.pt        torch.save of one dict per rank: this rank's Megatron weights (its TP
                           shard), optimizer state, RNG states, counters, extra_state
        manifest.json      written last by rank 0, after every rank's file is in place:
                           {format, version, rollout_id, world_size, tp, dp, weight_version,
                            files, hf_checkpoint, created_at}

Every file is written to a temporary name and renamed into place (atomic on a local file
system), and a checkpoint counts only once its manifest exists, so a reader never sees a
partial one. Paths are local folders (trainer checkpoints are per-rank files on the trainer's
node; an object-store copy is a separate concern).
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch

FORMAT = "vime-trainer-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or was written by a different layout."""


def checkpoint_root(cfg: Any) -> Path:
    from vime_core.report.records import run_dir

    return Path(run_dir(cfg.storage_uri, cfg.run_name, "checkpoints").removeprefix("file://"))


def checkpoint_dir(cfg: Any, rollout_id: int) -> Path:
    return checkpoint_root(cfg) / f"rollout_{rollout_id:06d}"


def rank_file(path: Path, rank: int) -> Path:
    return path / f"rank_{rank}.pt"


def _atomic_write(target: Path, write: Any) -> None:
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, target)


def save_rank_state(path: Path, rank: int, state: dict[str, Any]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    target = rank_file(path, rank)
    _atomic_write(target, lambda tmp: torch.save(state, tmp))
    return target


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    body = {"format": FORMAT, "version": FORMAT_VERSION, "created_at": time.time(), **manifest}
    _atomic_write(path / MANIFEST, lambda tmp: tmp.write_text(json.dumps(body, indent=2)))


def read_manifest(path: str | Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (not a checkpoint, or one that was never finished)")
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{file}: format {manifest.get('format')!r} v{manifest.get('version')} is not {FORMAT} v{FORMAT_VERSION}")
    return manifest


def load_rank_state(path: str | Path, rank: int, world_size: int, tp_size: int) -> dict[str, Any]:
    """This rank's state dict, after checking the manifest matches the current layout."""
    manifest = read_manifest(path)
    if manifest["world_size"] != world_size or manifest["tp"] != tp_size:
        raise CheckpointError(
            f"{path}: written with world_size={manifest['world_size']}, tp={manifest['tp']}; "
            f"this trainer has world_size={world_size}, tp={tp_size} (resharding is not supported)"
        )
    file = rank_file(Path(path), rank)
    if not file.is_file():
        raise CheckpointError(f"{file}: missing although the manifest lists it")
    return torch.load(file, map_location="cpu", weights_only=False)


def latest_checkpoint(cfg: Any) -> Optional[str]:
    """The finished checkpoint of the run with the highest rollout id, or None."""
    root = checkpoint_root(cfg)
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("rollout_*") if (p / MANIFEST).is_file())
    return str(done[-1]) if done else None


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU/CUDA, Megatron's tracker, python, numpy)."""
    import numpy as np
    from megatron.core import tensor_parallel

    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
        state["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
