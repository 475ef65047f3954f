"""An fsspec filesystem and a root path from a storage URI: a plain path or `file://` (local), `s3://`
(s3fs at the caller's `endpoint`, else this process's environment, vime_core.storage.endpoint), or
any other protocol fsspec knows. Credentials are left to botocore's chain and never passed, stored
or logged here; a URI carrying them is refused. Paths handed to pyarrow are plain paths, never URIs."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.endpoint import resolve as resolve_endpoint
from vime_core.utils.secrets import carries_userinfo, redact_url


@dataclass(frozen=True)
class StorageLocation:
    """A filesystem and the root path of the store inside it."""

    fs: Any  # fsspec.AbstractFileSystem
    root: str
    protocol: str
    endpoint: str = ""

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def url(self, key: str = "") -> str:
        """A URI for people (artifacts, logs): `s3://bucket/prefix/key` or an absolute path."""
        path = self.path(key)
        return path if self.is_local else f"{self.protocol}://{path}"

    def describe(self) -> str:
        return self.url() + (f" (endpoint {self.endpoint})" if self.endpoint else "")

    # ---- bytes in and out -------------------------------------------------------------------
    def put_atomic(self, key: str, data: bytes) -> None:
        """Write `data` so that a reader sees the old object or the whole new one, never a part.

        S3 PUTs are atomic by themselves; a local file is written beside and renamed.
        """
        path = self.path(key)
        parent = path.rsplit("/", 1)[0]
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        self.fs.makedirs(parent, exist_ok=True)
        partial = f"{parent}/.{path.rsplit('/', 1)[1]}.{uuid.uuid4().hex}.partial"
        with open(partial, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        if self.is_local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def put_file(self, key: str, local_path: str | os.PathLike) -> None:
        """Upload a local file (streamed: s3fs sends a large one in parts, so it is not held in
        memory). Not atomic by itself: a reader must learn of `key` only after this returns."""
        path = self.path(key)
        if self.is_local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.fs.put_file(os.fspath(local_path), path)

    def append_line(self, key: str, line: bytes) -> None:
        """Add one newline-ended line at the end of the object. A local file is appended to (one
        write); an object store has no append, so there the object is read, extended and
        replaced whole with put_atomic (linear in its length). A line cut short by a killed
        writer stays on its own line: the new one starts after a newline."""
        path = self.path(key)
        if self.is_local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            with open(path, "a+b") as f:
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = b"\n" + line
                f.write(line)
            return
        try:
            old = self.get(key)
        except FileNotFoundError:
            old = b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        self.put_atomic(key, old + line)

    def get(self, key: str) -> bytes:
        return self.fs.cat_file(self.path(key))

    def get_many(self, keys: list[str]) -> dict[str, bytes]:
        """{key: bytes}; concurrent on S3. Raises FileNotFoundError if any one is gone."""
        if not keys:
            return {}
        blobs = self.fs.cat([self.path(k) for k in keys], on_error="raise")
        return {k: blobs[self.path(k)] for k in keys}

    def move(self, src: str, dst: str) -> None:
        """Rename on a local disk (atomic); copy + delete on object stores (the copy is atomic)."""
        if self.is_local:
            self.fs.makedirs(self.path(dst).rsplit("/", 1)[0], exist_ok=True)
            os.replace(self.path(src), self.path(dst))
        else:
            self.fs.copy(self.path(src), self.path(dst))
            self.fs.rm_file(self.path(src))

    def delete(self, key: str) -> bool:
        """Remove one object; False if it was not there."""
        try:
            self.fs.rm_file(self.path(key))
            return True
        except FileNotFoundError:
            return False

    def list_keys(self, prefix: str) -> list[str]:
        """Keys of all objects under `prefix` (a folder), sorted; [] if there is none."""
        return [key for key, _ in self.list_with_times(prefix)]

    def list_with_times(self, prefix: str) -> list[tuple[str, float | None]]:
        """(key, modification time as a POSIX timestamp or None) of every object under prefix,
        sorted by key. Folder entries (some S3 servers list them) and hidden partial files are
        left out."""
        # as the filesystem spells its paths (fsspec's memory store puts a "/" before the root)
        base = self.fs._strip_protocol(self.path(prefix)).rstrip("/")
        try:
            found = self.fs.find(base, withdirs=False, detail=True)
        except FileNotFoundError:
            return []
        root = self.fs._strip_protocol(self.root).rstrip("/") + "/"
        out = []
        for path, info in sorted(found.items()):
            path = str(path)
            if info.get("type") != "file" or path == base or not path.startswith(root):
                continue
            key = path[len(root) :]
            if "/." in f"/{key}":  # a hidden partial below the root (the root itself may sit in a hidden folder)
                continue
            out.append((key, _mtime(info)))
        return out


def _mtime(info: dict) -> float | None:
    value = info.get("mtime", info.get("LastModified", info.get("created")))
    if value is None:
        return None
    return value.timestamp() if hasattr(value, "timestamp") else float(value)


def _refuse_userinfo(uri: str) -> None:
    if carries_userinfo(uri):
        raise ValueError(
            "storage URI carries credentials in its host part (scheme://user:secret@...): "
            "refused; put them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile"
        )


# fsspec reads a path holding one of these as a glob pattern (its cat of several keys, copy, rm),
# so a root holding one would fail at the first read of the index, not at its first write
GLOB_CHARACTERS = "[]*?"


def _refuse_glob(uri: str) -> None:
    found = [c for c in GLOB_CHARACTERS if c in uri]
    if found:
        raise ValueError(
            f"storage URI {redact_url(uri)!r} holds {''.join(found)!r}, which fsspec reads as a glob pattern: "
            "choose a folder or prefix without [ ] * ?"
        )


def open_location(uri: str, storage_options: dict | None = None, endpoint: S3Endpoint | None = None) -> StorageLocation:
    """The StorageLocation for `uri` (module docstring)."""
    if not uri:
        raise ValueError("storage URI is empty: give a local folder or s3://bucket/prefix")
    _refuse_glob(uri)
    options = dict(storage_options or {})
    if "://" not in uri or uri.startswith("file://"):
        local = uri[len("file://") :] if uri.startswith("file://") else uri
        root = str(Path(local).expanduser().resolve())
        return StorageLocation(fsspec.filesystem("file"), root, "file")
    _refuse_userinfo(uri)
    protocol, rest = uri.split("://", 1)
    root = rest.strip("/")
    if not root:
        raise ValueError(f"storage URI {protocol}://{rest} names no bucket")
    if protocol in ("s3", "s3a"):
        return _s3_location(root, options, endpoint if endpoint is not None else resolve_endpoint())
    return StorageLocation(fsspec.filesystem(protocol, **options), root, protocol)


def open_parent(uri: str, endpoint: S3Endpoint | None = None) -> tuple[StorageLocation, str]:
    """(the location of `uri`'s folder, `uri`'s last name in it): `s3://b/p/reports/r/config.json`
    -> (s3://b/p/reports/r, "config.json"); a bare local name is in the current directory."""
    parent, _, name = str(uri).rstrip("/").rpartition("/")
    if not name or parent.endswith(":/"):
        raise ValueError(f"{uri!r} names no object inside a folder or bucket")
    return open_location(parent or ".", endpoint=endpoint), name


def _s3_location(root: str, options: dict, where: S3Endpoint) -> StorageLocation:
    import s3fs  # boundary: the driver imports this module at start; s3fs (heavy) only for s3:// storage

    endpoint = options.pop("endpoint_url", None) or where.url
    client_kwargs = dict(options.pop("client_kwargs", {}))
    if where.region:
        client_kwargs.setdefault("region_name", where.region)
    config_kwargs = dict(options.pop("config_kwargs", {}))
    if endpoint:
        # Self-hosted S3 servers (SeaweedFS, MinIO, Ceph) serve buckets as paths, not host names.
        config_kwargs.setdefault("s3", {"addressing_style": "path"})
    if where.request_retries is not None:
        # botocore's own retries of each request (a refused connection is retried with a back-off)
        config_kwargs.setdefault("retries", {"max_attempts": where.request_retries})
    # Listings must not be cached: other processes publish batches while this one runs.
    options.setdefault("use_listings_cache", False)
    fs = s3fs.S3FileSystem(
        endpoint_url=endpoint or None, client_kwargs=client_kwargs, config_kwargs=config_kwargs, **options
    )
    return StorageLocation(fs, root, "s3", endpoint)
