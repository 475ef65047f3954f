"""vLLM's cache carried between hosts (vime_core/engines/vllm_cache.py) through the real S3 server:
a host stores what its start made, a fresh host gets every file back byte for byte, and the
credentials reach neither the archives' keys nor what restore and store report."""

from __future__ import annotations

import uuid

from vime_core.engines.vllm_cache import CarriedCache, archive_key, cached_files, entry_of
from vime_core.storage.fs import open_location

from .conftest import TEST_SECRET_KEY


def test_a_fresh_host_restores_from_s3_what_the_first_stored(s3_env, tmp_path):
    uri = s3_env.storage_uri(f"vllm-cache-{uuid.uuid4().hex[:8]}")
    first = tmp_path / "host1"
    made = {
        "torch_compile_cache/h/rank_0_0/backbone/a": bytes(range(256)) * 64,
        "modelinfos/m.json": b"{}",
    }
    one = CarriedCache(uri, first)
    assert one.restore().get("missing") is True
    for name, data in made.items():
        (first / name).parent.mkdir(parents=True, exist_ok=True)
        (first / name).write_bytes(data)
    stored = one.store()
    assert stored["stored_files"] == len(made) and "error" not in stored
    # one archive per entry; each partial was moved, not left beside
    assert open_location(uri).list_keys("") == sorted(archive_key(entry_of(name)) for name in made)

    fresh = tmp_path / "host2"
    restored = CarriedCache(uri, fresh).restore()
    assert restored["restored_files"] == len(made) and "error" not in restored
    assert {n: (fresh / n).read_bytes() for n in cached_files(fresh)} == made
    assert TEST_SECRET_KEY not in repr((stored, restored))
