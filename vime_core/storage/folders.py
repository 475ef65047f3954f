"""A folder of files (an HF export) published as one unit: a reader sees the previous folder or the new
one whole, never a mix or a part. On a local disk the staged folder is renamed into place; on an
object store its files go under a fresh prefix and `<key>/manifest.json`, written last in one PUT,
names it (the trainer checkpoint's rule), so an upload cut short is never read.

    staged = staging_dir(location, key)    # write the files here, then
    folder = publish_folder(location, key, staged, label="v8")"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from vime_core.storage.fs import StorageLocation

FORMAT = "vime-folder"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class FolderManifestError(ValueError):
    """A folder's manifest was written by something else or names no folder."""


def staging_dir(location: StorageLocation, key: str) -> Path:
    """A new, empty local folder to write the files into before publish_folder: beside the
    target on a local disk (the rename stays on one filesystem), else a temporary folder."""
    if location.is_local:
        target = Path(location.path(key))
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:12]}")
        staged.mkdir()
        return staged
    return Path(tempfile.mkdtemp(prefix="vime-folder-"))


def publish_folder(location: StorageLocation, key: str, staged: Path, label: str = "") -> str:
    """Publish the staged folder at `key` (module docstring); the staged folder is used up
    either way. Returns the key of the folder that now holds the files: `key` on a local disk,
    `key/<label>-<random>` on an object store."""
    try:
        if location.is_local:
            _rename_into_place(Path(location.path(key)), staged)
            return key
        return _upload_then_manifest(location, key, staged, label)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def published_folder(location: StorageLocation, key: str) -> str | None:
    """The path or URI of the folder published at `key` (what a reader loads), None if none is."""
    if location.is_local:
        return location.url(key) if os.path.isdir(location.path(key)) else None
    try:
        manifest = json.loads(location.get(f"{key}/{MANIFEST}"))
    except FileNotFoundError:
        return None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION or not manifest.get("folder"):
        raise FolderManifestError(
            f"{location.url(f'{key}/{MANIFEST}')}: format {manifest.get('format')!r} "
            f"v{manifest.get('version')} is not {FORMAT} v{FORMAT_VERSION}"
        )
    return location.url(f"{key}/{manifest['folder']}")


def _rename_into_place(target: Path, staged: Path) -> None:
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
        os.replace(target, old)
        os.replace(staged, target)
        shutil.rmtree(old)
    else:
        os.replace(staged, target)


def _upload_then_manifest(location: StorageLocation, key: str, staged: Path, label: str) -> str:
    name = f"{label}-{uuid.uuid4().hex[:12]}" if label else uuid.uuid4().hex[:12]
    files = sorted((p.relative_to(staged).as_posix(), p) for p in staged.rglob("*") if p.is_file())
    for relative, local in files:
        location.put_file(f"{key}/{name}/{relative}", local)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "folder": name,
        "files": sorted(relative for relative, _ in files),
        "created_at": time.time(),
    }
    location.put_atomic(f"{key}/{MANIFEST}", json.dumps(manifest, indent=2).encode())
    keep = (f"{key}/{MANIFEST}", f"{key}/{name}/")
    for stale in location.list_keys(key):
        if stale != keep[0] and not stale.startswith(keep[1]):
            location.delete(stale)
    return f"{key}/{name}"
