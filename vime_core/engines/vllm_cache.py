"""vLLM's cache carried between hosts (`vllm_cache_uri`): what a fresh host's engine would otherwise
make before it serves, kept in the run's storage (a folder or s3:// URI) as one tar archive.

vLLM keeps under its cache root (VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm):
- `torch_compile_cache/<hash>/...`: torch.compile's artifacts. The hash covers vLLM's configuration,
  its code, the compiler and the device (vLLM's compile backend), so an archive can hold the
  entries of several configurations and devices: an engine uses the one of its own hash, else
  compiles anew (21 s of a fresh 0.5B start on an H200, docs/measurements.md).
- `modelinfos/`: what vLLM learned inspecting the model class (31 s there on a cold cache).

`restore` (before the launch) unpacks the archive's files the host lacks; `store` (once the engine
serves) writes the host's whole cache back when it holds files the archive did not bring. The
engines of one host take turns (a lock file in the cache root), so none launches vLLM beside a file
another is still unpacking. Two hosts that store at once each write their own archive and the last
one stays (the other's new entries are made again on its next start); a file vLLM is still writing
when stored may be caught half-written, and vLLM compiles or inspects anew where its entry does not
load.
The archive is only ever unpacked into the cache root: members that would land outside it, links
and special files are refused (tarfile's `data` filter)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tarfile
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.fs import open_location
from vime_core.utils.secrets import redact_url

log = logging.getLogger(__name__)

ARCHIVE = "vllm-cache.tar"
LOCK = ".vime-carried-cache.lock"  # in the cache root: one restore or store at a time per host


def cache_root(environ: Mapping[str, str]) -> Path:
    """The cache root vLLM uses with `environ` (vllm.envs.VLLM_CACHE_ROOT's rule)."""
    if environ.get("VLLM_CACHE_ROOT"):
        return Path(environ["VLLM_CACHE_ROOT"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "vllm"


def cached_files(root: Path) -> set[str]:
    """Every regular file under `root`, as paths relative to it."""
    if not root.is_dir():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != LOCK}


@contextlib.contextmanager
def host_turn(root: Path) -> Iterator[None]:
    """This host's engines one at a time in `root` (an exclusive lock on a file there)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class CarriedCache:
    """The cache root `root` of this host and the archive at `uri` (module docstring)."""

    @classmethod
    def of(cls, cfg: Any, environ: Mapping[str, str]) -> "CarriedCache":
        """The configuration's archive (vllm_cache_uri, its S3 endpoint) and the cache root of an
        engine launched with `environ`."""
        return cls(cfg.vllm_cache_uri, cache_root(environ), S3Endpoint.of(cfg))

    def __init__(self, uri: str, root: Path, endpoint: S3Endpoint | None = None) -> None:
        self.uri = uri
        self.root = root
        self.endpoint = endpoint
        self._known: set[str] | None = None  # the files the host held after restore (None: not restored)

    def restore(self) -> dict[str, Any]:
        """Unpack the archive's files this host lacks into the cache root; what it did, for the
        engine's log: files and bytes unpacked, seconds, or `missing` when no archive is stored.
        A failure to read the archive is logged and leaves the host's cache as it was."""
        started = time.monotonic()
        with host_turn(self.root):
            out = self._restore()
        out["seconds"] = time.monotonic() - started
        return out

    def _restore(self) -> dict[str, Any]:
        location = open_location(self.uri, endpoint=self.endpoint)
        have = cached_files(self.root)
        out: dict[str, Any] = {"restored_files": 0, "restored_bytes": 0}
        try:
            if not location.fs.exists(location.path(ARCHIVE)):
                out["missing"] = True
            else:
                with tempfile.TemporaryDirectory(prefix="vime-vllm-cache-") as tmp:
                    local = Path(tmp) / ARCHIVE
                    location.fs.get_file(location.path(ARCHIVE), str(local))
                    with tarfile.open(local) as tar:
                        members = [m for m in tar.getmembers() if m.isfile() and m.name not in have]
                        tar.extractall(self.root, members=members, filter="data")
                    out.update(restored_files=len(members), restored_bytes=sum(m.size for m in members))
        except (OSError, tarfile.TarError) as exc:
            log.warning(
                "vllm_cache_uri %s: could not restore %s (%s); vLLM starts with the host's cache",
                redact_url(self.uri),
                ARCHIVE,
                exc,
            )
            out["error"] = f"{type(exc).__name__}: {exc}"
        self._known = cached_files(self.root)
        return out

    def store(self) -> dict[str, Any]:
        """Write the host's cache root as the archive when it holds files that were not there after
        `restore` (what this start compiled or inspected); `stored_files` 0 when nothing is new."""
        started = time.monotonic()
        with host_turn(self.root):
            out = self._store()
        return {**out, "seconds": time.monotonic() - started}

    def _store(self) -> dict[str, Any]:
        now = cached_files(self.root)
        new = now - (self._known or set())
        out: dict[str, Any] = {"stored_files": 0, "new_files": len(new)}
        if not new:
            return out
        location = open_location(self.uri, endpoint=self.endpoint)
        partial = f".{ARCHIVE}.{os.getpid()}.{time.time_ns()}.partial"
        try:
            with tempfile.TemporaryDirectory(prefix="vime-vllm-cache-") as tmp:
                local = Path(tmp) / ARCHIVE
                with tarfile.open(local, "w") as tar:
                    for name in sorted(now):
                        tar.add(self.root / name, arcname=name, recursive=False)
                location.put_file(partial, local)  # then renamed: a reader sees the old archive or the new
                location.move(partial, ARCHIVE)
                out.update(stored_files=len(now), stored_bytes=local.stat().st_size)
        except OSError as exc:
            log.warning("vllm_cache_uri %s: could not store %s (%s)", redact_url(self.uri), ARCHIVE, exc)
            out["error"] = f"{type(exc).__name__}: {exc}"
            location.delete(partial)
        self._known = now
        return out
