"""The trainer checkpoint on disk: `<storage>/checkpoints/<run>/rollout_<k:06d>/` holds one
`rank_<r>.pt` per rank (weights shard, optimizer, RNG states, counters), `critic_rank_<r>.pt` with a
critic, and `manifest.json`, written last by rank 0. Every file is written atomically and a
checkpoint counts only once its manifest exists, so a reader never sees a partial one. Rank files
are read with torch's weights-only unpickler, so writing to the run's storage cannot run code here."""

from __future__ import annotations

import io
import json
import pickle
import random
import re
import time
from typing import Any, Optional

import numpy as np
import torch

from vime_core.report.records import run_dir
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.fs import open_location

FORMAT = "vime-trainer-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
CHECKPOINT_NAME = re.compile(r"rollout_(\d+)")  # checkpoint_dir's folder name


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or was written by a different layout."""


def checkpoint_root(cfg: Any, critic: bool = False) -> str:
    """The run's checkpoints, `<storage>/checkpoints/<run>`; with `critic`, where its critic
    files go: `<critic_save>/<run>` when critic_save is set, else the same."""
    if critic and cfg.critic_save:
        return f"{cfg.critic_save.rstrip('/')}/{cfg.run_name}"
    return run_dir(cfg.storage_uri, cfg.run_name, "checkpoints")


def checkpoint_dir(cfg: Any, rollout_id: int, critic: bool = False) -> str:
    """The folder of the checkpoint after `rollout_id` (with `critic`: of its critic files)."""
    return f"{checkpoint_root(cfg, critic)}/rollout_{rollout_id:06d}"


def critic_dir(path: str, manifest: dict[str, Any]) -> str:
    """The folder of the critic files of the checkpoint at `path`: the one its manifest names,
    else `path` itself (the default, and every checkpoint written before critic_save)."""
    return manifest.get("critic_dir") or path


def rank_file_name(rank: int, critic: bool = False) -> str:
    return f"critic_rank_{rank}.pt" if critic else f"rank_{rank}.pt"


def save_rank_state(
    path: str, rank: int, state: dict[str, Any], endpoint: Optional[S3Endpoint] = None, critic: bool = False
) -> str:
    """One rank's file (its critic's with `critic`)."""
    name = rank_file_name(rank, critic)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    open_location(path, endpoint=endpoint).put_atomic(name, buffer.getvalue())
    return f"{path.rstrip('/')}/{name}"


def write_manifest(path: str, manifest: dict[str, Any], endpoint: Optional[S3Endpoint] = None) -> None:
    body = {"format": FORMAT, "version": FORMAT_VERSION, "created_at": time.time(), **manifest}
    open_location(path, endpoint=endpoint).put_atomic(MANIFEST, json.dumps(body, indent=2).encode())


def _read(path: str, name: str, missing: str, endpoint: Optional[S3Endpoint] = None) -> bytes:
    """The bytes of `name` in the checkpoint folder `path`; CheckpointError(`missing`) if absent."""
    try:
        return open_location(path, endpoint=endpoint).get(name)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: {missing}") from None


def read_manifest(path: str, endpoint: Optional[S3Endpoint] = None) -> dict[str, Any]:
    manifest = json.loads(
        _read(path, MANIFEST, f"no {MANIFEST} (not a checkpoint, or one that was never finished)", endpoint)
    )
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            (
                f"{path}/{MANIFEST}: format {manifest.get('format')!r} v{manifest.get('version')} is not {FORMAT} "
                f"v{FORMAT_VERSION}"
            )
        )
    return manifest


def load_rank_state(
    path: str,
    rank: int,
    world_size: int,
    tp_size: int,
    endpoint: Optional[S3Endpoint] = None,
    critic: bool = False,
    ep_size: int = 1,
) -> dict[str, Any]:
    """This rank's state dict (its critic's with `critic`, from the manifest's critic_dir),
    after checking the manifest matches the current layout (a manifest without `ep` was written at EP=1)."""
    manifest = read_manifest(path, endpoint)
    written = (manifest["world_size"], manifest["tp"], manifest.get("ep", 1))
    if written != (world_size, tp_size, ep_size):
        raise CheckpointError(
            f"{path}: written with world_size={written[0]}, tp={written[1]}, ep={written[2]}; "
            f"this trainer has world_size={world_size}, tp={tp_size}, ep={ep_size} (resharding is not supported)"
        )
    name = rank_file_name(rank, critic)
    folder = critic_dir(path, manifest) if critic else path
    data = _read(folder, name, f"{name} is missing although {path}/{MANIFEST} lists it", endpoint)
    return load_state_bytes(data, f"{folder.rstrip('/')}/{name}")


# numpy's RNG state (capture_rng_state) is a tuple holding a uint32 array: these rebuild plain arrays.
_NUMPY_RNG_GLOBALS = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _refusal_reason(exc: pickle.UnpicklingError) -> str:
    """The global torch's weights-only unpickler refused, from its long message."""
    found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    if found:
        return f"unsupported global {found.group(1)}"
    found = re.search(r"WeightsUnpickler error: ([^\n]+)", str(exc))
    return found.group(1).strip() if found else type(exc).__name__


def load_state_bytes(data: bytes, where: str) -> dict[str, Any]:
    """A rank file's state dict, unpickled with torch's weights-only unpickler: tensors, numbers,
    strings and the containers of them (and numpy's RNG state arrays) load; any other object is
    refused with CheckpointError naming `where`. Rule: nothing read from storage runs code; whoever
    can write to the run's bucket must not be able to run code in every trainer rank."""
    try:
        with torch.serialization.safe_globals(_NUMPY_RNG_GLOBALS):
            state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{where}: refused to load: it holds a pickled object that is not tensors or plain "
            f"data ({_refusal_reason(exc)}); vime writes none, so the file was not written by vime or was changed "
            f"since"
        ) from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: holds a {type(state).__name__}, not a vime rank state (a dict)")
    return state


def latest_checkpoint(cfg: Any) -> Optional[str]:
    """The finished checkpoint of the run with the highest rollout id, or None."""
    done = finished_checkpoints(cfg)
    return done[-1][1] if done else None


def finished_checkpoints(cfg: Any) -> list[tuple[int, str]]:
    """(rollout id, folder) of every finished checkpoint of the run (its manifest written), by rollout id."""
    root = checkpoint_root(cfg)
    location = open_location(root, endpoint=S3Endpoint.of(cfg))
    try:
        names = [p.rstrip("/").rsplit("/", 1)[-1] for p in location.fs.ls(location.path(""), detail=False)]
    except FileNotFoundError:
        return []
    ids = {n: int(m.group(1)) for n in names if (m := CHECKPOINT_NAME.fullmatch(n))}  # not a copy (rollout_7.bak)
    done = sorted((k, n) for n, k in ids.items() if location.fs.isfile(location.path(f"{n}/{MANIFEST}")))
    return [(k, f"{root.rstrip('/')}/{n}") for k, n in done]


def capture_rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (torch CPU/CUDA, Megatron's tracker, python, numpy)."""
    # boundary: the driver imports this module (tasks/bootstrap: latest_checkpoint); megatron only in the trainer
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
    # boundary: the driver imports this module (tasks/bootstrap: latest_checkpoint); megatron only in the trainer
    from megatron.core import tensor_parallel

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
        tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
