"""vLLM's cache carried between hosts (vime_core/engines/vllm_cache.py) through a local folder: what a
host lacks is unpacked, what it has is left alone, a start that made nothing new stores nothing, an
archive that would write outside the cache root is refused, and a URI with credentials is refused
at configuration time. The same through a real S3 server: tests/integration/storage; with real vLLM
engines: tests/integration/rollout/test_vllm_cache_engine.py."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from vime_core.engines.vllm_cache import (
    TRITON_DIR,
    CarriedCache,
    archive_key,
    cache_root,
    cached_files,
    engine_triton_cache,
    entry_of,
)


def _write(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def _start(store: str, root: Path, makes: dict[str, bytes]) -> dict:
    """One engine start on the host of `root`: restore, the files the start makes, store."""
    cache = CarriedCache(store, root)
    cache.restore()
    _write(root, makes)
    return cache.store()


def _read(root: Path) -> dict[str, bytes]:
    return {name: (root / name).read_bytes() for name in cached_files(root)}


def _stored(store: Path) -> list[str]:
    """Every file in the store's folder, relative to it (archives and anything left beside)."""
    return sorted(str(p.relative_to(store)) for p in store.rglob("*") if p.is_file())


def test_the_cache_root_is_vllms():
    assert cache_root({"VLLM_CACHE_ROOT": "/a/b", "XDG_CACHE_HOME": "/x"}) == Path("/a/b")
    assert cache_root({"XDG_CACHE_HOME": "/x", "HOME": "/h"}) == Path("/x/vllm")
    assert cache_root({"HOME": "/h"}) == Path("/h/.cache/vllm")
    assert engine_triton_cache({"HOME": "/h"}) == Path("/h/.cache/vllm") / TRITON_DIR  # carried with it


def test_a_fresh_host_gets_what_the_first_host_made(tmp_path):
    store = str(tmp_path / "store")
    first, fresh = tmp_path / "host1", tmp_path / "host2"
    made = {
        "torch_compile_cache/abc123/rank_0_0/backbone/artifact": b"\x00compiled" * 100,
        "modelinfos/vllm-model_executor-models-qwen3-Qwen3ForCausalLM.json": b'{"is_text_generation_model": true}',
        # a Triton kernel the engine JIT-compiled into its TRITON_CACHE_DIR (engine_triton_cache): two files, one entry
        f"{TRITON_DIR}/Q2XVN7KJ3M/_topk_topp_kernel.cubin": b"\x7fELF" * 50,
        f"{TRITON_DIR}/Q2XVN7KJ3M/__grp___topk_topp_kernel.json": b'{"child_paths": {}}',
    }
    entries = {entry_of(name) for name in made}

    one = CarriedCache(store, first)
    assert one.restore()["missing"] is True  # nothing stored yet: vLLM starts with the host's cache
    _write(first, made)  # what the start compiled and inspected
    stored = one.store()
    assert stored["stored_files"] == len(made) and stored["new_files"] == len(made)
    # one archive per entry (a compile hash, a model's inspection), no partial left beside
    assert _stored(tmp_path / "store") == sorted(archive_key(entry) for entry in entries)
    assert stored["stored_entries"] == len(entries) == 3

    _write(fresh, {"modelinfos/other.json": b"mine"})  # the fresh host's own file stays
    two = CarriedCache(store, fresh)
    restored = two.restore()
    assert restored["restored_files"] == len(made) and restored["restored_bytes"] == sum(map(len, made.values()))
    assert _read(fresh) == {**made, "modelinfos/other.json": b"mine"}
    assert two.store()["stored_files"] == 0  # this start made nothing new: no upload

    # a warm host (it holds every entry) downloads nothing
    assert CarriedCache(store, fresh).restore()["restored_entries"] == 0


def test_a_host_keeps_its_own_copy_of_a_file_the_archive_also_has(tmp_path):
    store = str(tmp_path / "store")
    _start(store, tmp_path / "host1", {"modelinfos/m.json": b"archived"})
    _write(tmp_path / "host2", {"modelinfos/m.json": b"the host's"})
    assert CarriedCache(store, tmp_path / "host2").restore()["restored_files"] == 0
    assert (tmp_path / "host2" / "modelinfos/m.json").read_bytes() == b"the host's"


def test_new_entries_of_a_second_host_join_the_store(tmp_path):
    store = str(tmp_path / "store")
    first, second = {"torch_compile_cache/h1/x": b"1"}, {"torch_compile_cache/h2/x": b"2"}
    _start(store, tmp_path / "a", first)
    # another configuration compiled on the second host: only its own entry is written
    assert _start(store, tmp_path / "b", second)["stored_files"] == len(second)
    three = CarriedCache(store, tmp_path / "c")
    assert three.restore()["restored_files"] == len(first) + len(second)


def test_two_hosts_storing_at_once_lose_nothing_of_each_other(tmp_path):
    """Both restore the same (empty) store, each compiles another configuration, both store: a
    third host gets both entries (one archive of the whole cache would keep the last writer's)."""
    store = str(tmp_path / "store")
    makes = [{"torch_compile_cache/h1/a": b"1", "modelinfos/m.json": b"{}"}, {"torch_compile_cache/h2/a": b"2"}]
    hosts = [CarriedCache(store, tmp_path / f"host{i}") for i in range(2)]
    for host in hosts:
        host.restore()
    for host, made in zip(hosts, makes):
        _write(host.root, made)
    for host in hosts:
        host.store()
    third = tmp_path / "third"
    CarriedCache(store, third).restore()
    assert _read(third) == {**makes[0], **makes[1]}


def test_an_entry_grown_on_a_host_is_written_again_whole(tmp_path):
    """A start that adds files to an entry it restored (a compile of another shape in the same
    configuration) writes that entry's archive again with every file of it."""
    store = str(tmp_path / "store")
    _start(store, tmp_path / "a", {"torch_compile_cache/h/shape1": b"1"})
    stored = _start(store, tmp_path / "b", {"torch_compile_cache/h/shape2": b"2"})
    assert (stored["stored_entries"], stored["stored_files"]) == (1, 2)
    fresh = tmp_path / "c"
    CarriedCache(store, fresh).restore()
    assert _read(fresh) == {"torch_compile_cache/h/shape1": b"1", "torch_compile_cache/h/shape2": b"2"}


@pytest.mark.parametrize("member", ["../outside", "/tmp/absolute-vime-test", "link"])
def test_an_archive_never_writes_outside_the_cache_root(tmp_path, member):
    """A member that climbs out is refused (tarfile's data filter); an absolute one lands inside the
    root; a link is not a file and is never unpacked."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo(member)
        if member == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 3
            tar.addfile(info, io.BytesIO(b"bad"))
    archive = tmp_path / "store" / archive_key("torch_compile_cache/bad")
    archive.parent.mkdir(parents=True)
    archive.write_bytes(buffer.getvalue())
    root = tmp_path / "deep" / "host"
    out = CarriedCache(str(tmp_path / "store"), root).restore()
    assert not (tmp_path / "deep" / "outside").exists() and not Path("/tmp/absolute-vime-test").exists()
    assert not (root / "link").exists()
    if member == "../outside":
        assert "error" in out and out["restored_files"] == 0  # vLLM starts with the host's cache
    elif member.startswith("/"):
        assert (root / member.lstrip("/")).read_bytes() == b"bad"


def test_a_cache_uri_with_credentials_is_refused_naming_the_field():
    from vime_core.config import make_config
    from vime_core.config.loader import ConfigError

    with pytest.raises(ConfigError, match="vllm_cache_uri carries credentials") as err:
        make_config({"vllm_cache_uri": "s3://AKIDEXAMPLE:hunter2@bucket/cache"})
    assert "hunter2" not in str(err.value)
    assert make_config({"vllm_cache_uri": "s3://bucket/cache"}).vllm_cache_uri == "s3://bucket/cache"


def test_the_engines_of_one_host_take_turns(tmp_path):
    """A restore waits while another engine of the host holds the turn (it may be unpacking a
    file this one would otherwise find half-written and skip)."""
    import threading

    from vime_core.engines.vllm_cache import host_turn

    store = str(tmp_path / "store")
    _start(store, tmp_path / "first", {"modelinfos/m.json": b"{}"})
    root = tmp_path / "shared-host"
    done = []
    with host_turn(root):
        worker = threading.Thread(target=lambda: done.append(CarriedCache(store, root).restore()))
        worker.start()
        worker.join(timeout=0.5)
        assert worker.is_alive() and not done  # waiting for the turn
    worker.join(timeout=10)
    assert done[0]["restored_files"] == 1
    assert set(cached_files(root)) == {"modelinfos/m.json"}  # the lock file is not a cached file
