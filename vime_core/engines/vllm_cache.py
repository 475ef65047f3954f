"""vLLM's cache carried between hosts (`vllm_cache_uri`): what a fresh host's engine would otherwise
make before it serves, kept in the run's storage (a folder or s3:// URI) as one tar archive per
cache entry.

vLLM keeps under its cache root (VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm):
- `torch_compile_cache/<hash>/...`: torch.compile's artifacts. The hash covers vLLM's configuration,
  its code, the compiler and the device (vLLM's compile backend), so the entries of several
  configurations and devices live side by side: an engine uses the one of its own hash, else
  compiles anew (21 s of a fresh 0.5B start on an H200, docs/measurements.md).
- `modelinfos/<file>`: what vLLM learned inspecting a model class (31 s there on a cold cache).
- `triton_cache/<kernel hash>/...`: the Triton kernels the engine JIT-compiled, there because vime
  points the engine's TRITON_CACHE_DIR at it (`engine_triton_cache`).
An entry is a file's first two path components (`entry_of`); its archive is `<uri>/<entry>.tar`.

`restore` (before the launch) unpacks, from the archive of each entry the host holds nothing of,
the files; a warm host downloads nothing. `store` (once the engine serves) writes again the
archive of each entry in which this start made files. Two hosts that store at once lose nothing of
each other's: their new entries are different archives, and the same entry made on both (one
configuration on one kind of device) is the same content, whichever write stays. The engines of one
host take turns (a lock file in the cache root), so none launches vLLM beside a file another is
still unpacking. A file vLLM is still writing when stored may be caught half-written, and vLLM
compiles or inspects anew where its entry does not load.
Archives are only ever unpacked into the cache root: members that would land outside it, links
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
from vime_core.storage.fs import StorageLocation, open_location
from vime_core.utils.secrets import redact_url

log = logging.getLogger(__name__)

ARCHIVE_SUFFIX = ".tar"
LOCK = ".vime-carried-cache.lock"  # in the cache root: one restore or store at a time per host


def cache_root(environ: Mapping[str, str]) -> Path:
    """The cache root vLLM uses with `environ` (vllm.envs.VLLM_CACHE_ROOT's rule)."""
    if environ.get("VLLM_CACHE_ROOT"):
        return Path(environ["VLLM_CACHE_ROOT"]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "vllm"


TRITON_DIR = "triton_cache"


def engine_triton_cache(environ: Mapping[str, str]) -> Path:
    """The Triton kernel cache an engine launched with `environ` is given (its TRITON_CACHE_DIR, unless
    set): `triton_cache` under vLLM's cache root, one folder for every start of the host.

    Left to vLLM (0.26, torch >= 2.10), the folder moves with the compile cache's answer. A start
    that compiles points TRITON_CACHE_DIR at `torch_compile_cache/<hash>/.../triton_cache`
    (compilation/compiler_interface.py, the Inductor adaptor's initialize_cache), and the kernels
    JIT-compiled after the graphs (the V2 model runner's `warmup_kernels`: sampling, penalties,
    log-probs) land there. A start whose compile cache hits loads the AOT artifact instead
    (VLLM_USE_AOT_COMPILE, on by default with torch >= 2.10), sets no TRITON_CACHE_DIR
    (compilation/caching.py: initialize_cache with disable_cache), and looks for those kernels in
    Triton's default ~/.triton/cache: the first hit of each host compiles them again (19 s of a
    0.5B warm start on an H100; the next hit 1 s, docs/measurements.md). One folder under the cache
    root serves both answers, and `vllm_cache_uri` carries it with the compiled graphs. Triton's own
    keys (the kernel's source, its constants, the device, Triton's version) keep kernels apart."""
    return cache_root(environ) / TRITON_DIR


def cached_files(root: Path) -> set[str]:
    """Every regular file under `root`, as paths relative to it."""
    if not root.is_dir():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and not p.is_symlink() and p.name != LOCK}


def entry_of(name: str) -> str:
    """The cache entry of the file `name` (relative to the cache root): its first two components."""
    return "/".join(Path(name).parts[:2])


def archive_key(entry: str) -> str:
    return entry + ARCHIVE_SUFFIX


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
        """Unpack into the cache root the files of each stored entry the host holds nothing of; what
        it did, for the engine's log: entries, files and bytes unpacked, seconds, or `missing` when
        nothing is stored. An archive that cannot be read is logged and skipped; the host's cache
        keeps what it had."""
        started = time.monotonic()
        with host_turn(self.root):
            out = self._restore()
        out["seconds"] = time.monotonic() - started
        return out

    def _restore(self) -> dict[str, Any]:
        location = open_location(self.uri, endpoint=self.endpoint)
        have = cached_files(self.root)
        held = {entry_of(name) for name in have}
        out: dict[str, Any] = {"restored_entries": 0, "restored_files": 0, "restored_bytes": 0}
        try:
            keys = [key for key in location.list_keys("") if key.endswith(ARCHIVE_SUFFIX)]  # partials are hidden
        except OSError as exc:
            keys = []
            self._failed(out, "list", exc)
        if not keys and "error" not in out:
            out["missing"] = True
        for key in keys:
            if key.removesuffix(ARCHIVE_SUFFIX) in held:
                continue  # the host has this entry (made or restored before): nothing to fetch
            try:
                members = self._unpack(location, key, have)
            except (OSError, tarfile.TarError) as exc:
                self._failed(out, f"restore {key}", exc)  # the other entries still come
                continue
            out["restored_entries"] += 1
            out["restored_files"] += len(members)
            out["restored_bytes"] += sum(m.size for m in members)
        self._known = cached_files(self.root)
        return out

    def _unpack(self, location: StorageLocation, key: str, have: set[str]) -> list[tarfile.TarInfo]:
        """The files of the archive at `key` that the host lacks, unpacked into the cache root."""
        with tempfile.TemporaryDirectory(prefix="vime-vllm-cache-") as tmp:
            local = Path(tmp) / "entry.tar"
            location.fs.get_file(location.path(key), str(local))
            with tarfile.open(local) as tar:
                members = [m for m in tar.getmembers() if m.isfile() and m.name not in have]
                tar.extractall(self.root, members=members, filter="data")
        return members

    def _failed(self, out: dict[str, Any], what: str, exc: BaseException) -> None:
        """Log a failure to move one archive; the engine starts or serves all the same."""
        log.warning("vllm_cache_uri %s: could not %s (%s)", redact_url(self.uri), what, exc)
        out["error"] = f"{type(exc).__name__}: {exc}"

    def store(self) -> dict[str, Any]:
        """Write the archive of each entry in which the host holds files that were not there after
        `restore` (what this start compiled or inspected); `stored_entries` 0 when nothing is new."""
        started = time.monotonic()
        with host_turn(self.root):
            out = self._store()
        return {**out, "seconds": time.monotonic() - started}

    def _store(self) -> dict[str, Any]:
        now = cached_files(self.root)
        new = now - (self._known or set())
        out: dict[str, Any] = {"stored_entries": 0, "stored_files": 0, "stored_bytes": 0, "new_files": len(new)}
        location = open_location(self.uri, endpoint=self.endpoint) if new else None
        for entry in sorted({entry_of(name) for name in new}):
            files = sorted(name for name in now if entry_of(name) == entry)
            try:
                out["stored_bytes"] += self._pack(location, archive_key(entry), files)
            except OSError as exc:
                self._failed(out, f"store {archive_key(entry)}", exc)
                continue
            out["stored_entries"] += 1
            out["stored_files"] += len(files)
        self._known = now
        return out

    def _pack(self, location: StorageLocation, key: str, files: list[str]) -> int:
        """The archive of `files` at `key`, written whole or not at all; its size in bytes."""
        partial = str(Path(key).with_name(f".{Path(key).name}.{os.getpid()}.{time.time_ns()}.partial"))
        with tempfile.TemporaryDirectory(prefix="vime-vllm-cache-") as tmp:
            local = Path(tmp) / "entry.tar"
            with tarfile.open(local, "w") as tar:
                for name in files:
                    tar.add(self.root / name, arcname=name, recursive=False)
            try:
                location.put_file(partial, local)  # then renamed: a reader sees the old archive or the new
                location.move(partial, key)
            except OSError:
                location.delete(partial)
                raise
            return local.stat().st_size
