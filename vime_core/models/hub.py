"""`hf_checkpoint` -> a local folder, once, on the driver: a local folder, or a hub id (`org/name[@rev]`)
fetched with snapshot_download into the usual cache (the cached snapshot offline), so actors and
engines only see a local path. An id that cannot be resolved fails here, before anything starts. Only
configs, safetensors and tokenizer files are downloaded; HF_TOKEN is huggingface_hub's, never logged."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from vime_core.utils.errors import first_line

log = logging.getLogger(__name__)

# What the trainer, vLLM and the tokenizer read; not *.bin/*.pth/onnx/gguf copies of the weights.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]

# huggingface_hub's repo id rule: one optional namespace, names of letters, digits, '-', '_', '.'.
_REPO_ID = re.compile(r"(?:[A-Za-z0-9][\w.-]*/)?[A-Za-z0-9][\w.-]*")


class HubCheckpointError(FileNotFoundError):
    """``hf_checkpoint`` names neither a local folder nor a hub snapshot that can be had."""


def hub_cache_dir() -> Path:
    """The hub cache as huggingface_hub lays it out, from the environment at call time (its own
    constant is read once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` for ``org/name[@revision]``, None when ``value`` is not one."""
    repo_id, _, revision = value.partition("@")
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id or repo_id.endswith((".", "-")) or "@" in revision:
        return None
    return repo_id, revision or None


def resolve_hf_checkpoint(value: str, base: Path, field: str = "hf_checkpoint") -> str:
    """The local folder of ``hf_checkpoint=value``: itself (absolute) when it is a folder, else
    the hub snapshot of ``org/name[@revision]`` (downloaded, or from the cache offline). `field`
    names the setting in errors (opd_teacher_load resolves the same way)."""
    local = Path(value.removeprefix("file://")).expanduser()
    local = local if local.is_absolute() else base / local
    if local.is_dir():
        if not (local / "config.json").is_file():  # else the trainer and every engine fail on it, later
            raise HubCheckpointError(
                f"{field}: {local} holds no config.json: not a Hugging Face model folder "
                "(config.json, tokenizer files and *.safetensors)"
            )
        return os.path.abspath(local)
    parsed = parse_hub_id(value)
    if parsed is None or value.startswith(("/", ".", "~", "file://")):
        raise HubCheckpointError(
            f"{field}: {value!r} is not a folder ({local} does not exist) and not a hub id (org/name)"
        )
    return str(snapshot_folder(*parsed, note=f"; no folder {local} either" if "/" in value else "", field=field))


def snapshot_folder(repo_id: str, revision: str | None = None, note: str = "", field: str = "hf_checkpoint") -> Path:
    """The snapshot folder of a hub model, downloaded when online, from the cache offline."""
    cache, offline = hub_cache_dir(), hub_offline()
    shown = repo_id + (f"@{revision}" if revision else "")
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=str(cache),
                local_files_only=offline,
                allow_patterns=ALLOW_PATTERNS,
            )
        )
    except LocalEntryNotFoundError:
        how = "HF_HUB_OFFLINE=1" if offline else "the hub could not be reached"
        raise HubCheckpointError(
            f"{field}: hub model {shown!r} has no cached snapshot in {cache} and {how}{note}; download it where "
            f"there is network (`hf download {repo_id}` with the same HF_HUB_CACHE/HF_HOME) or pass a local folder"
        ) from None
    except (HfHubHTTPError, ValueError) as error:  # not found, gated (needs HF_TOKEN), bad revision
        raise HubCheckpointError(f"{field}: hub model {shown!r}: {type(error).__name__}: {first_line(error)}") from None
    if not (folder / "config.json").is_file():
        raise HubCheckpointError(f"{field}: the snapshot of {shown!r} at {folder} has no config.json")
    log.info("%s %s -> %s", field, shown, folder)
    return folder
