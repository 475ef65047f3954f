"""The seconds a transport reports per phase (`transport.timings`, published as
`transport_seconds`): each key is the time spent in that phase, summed over the buckets."""

from __future__ import annotations

import asyncio

import pytest
import torch

from vime_core.utils import timing
from vime_core.weight_sync.buckets import iter_buckets
from vime_core.weight_sync.transport import disk, shm
from vime_core.weight_sync.transport.shm_pool import ShmBufferPool

# seconds each engine call takes on the fake clock
ENGINE_SECONDS = {
    "collective_rpc": 3.0,
    "update_weight_version": 0.5,
    "update_weights": 1.5,
    "finish_weight_update": 0.25,
}
WRITE_SECONDS = 2.0


@pytest.fixture
def clock(monkeypatch):
    """A fake perf_counter that moves only when a stand-in call moves it: seconds are exact."""
    now = [10.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    return now


def engines_on(transport, clock) -> list[str]:
    """Stand in for every engine: each call advances the clock by its ENGINE_SECONDS."""
    calls = []

    async def on_every_engine(method, *args, **kwargs):
        calls.append(method)
        clock[0] += ENGINE_SECONDS.get(method, 0.0)
        return [None]

    transport.on_every_engine = on_every_engine
    return calls


def buckets(n: int):
    tensors = {f"w{i}": torch.randn(4, 4) for i in range(n)}
    one = tensors["w0"].numel() * tensors["w0"].element_size()
    return list(iter_buckets(tensors.items(), one, None))  # one tensor per bucket


def test_disk_times_each_write_summed_then_reload_and_finish(clock, monkeypatch, tmp_path):
    def slow_write(bucket, folder):
        clock[0] += WRITE_SECONDS

    monkeypatch.setattr(disk, "write_bucket_safetensors", slow_write)
    transport = disk.DiskTransport(str(tmp_path))
    engines_on(transport, clock)
    three = buckets(3)
    assert len(three) == 3

    async def publish():
        await transport.start()
        for bucket in three:
            await transport.send_bucket(bucket)
        await transport.finish(1)
        await transport.close()

    asyncio.run(publish())
    assert transport.timings == {
        "write": len(three) * WRITE_SECONDS,
        "reload": ENGINE_SECONDS["collective_rpc"],
        "finish": ENGINE_SECONDS["update_weight_version"],
    }


def test_shm_times_pack_the_wait_for_the_load_and_finish(clock, monkeypatch, tmp_path):
    real_write = shm.write_bucket_file

    def slow_write(bucket, pool, checksums=True):
        clock[0] += WRITE_SECONDS
        return real_write(bucket, pool)

    monkeypatch.setattr(shm, "write_bucket_file", slow_write)
    pool = ShmBufferPool(str(tmp_path))
    transport = shm.ShmTransport(pool=pool)
    calls = engines_on(transport, clock)
    (bucket,) = buckets(1)

    async def publish():
        await transport.prepare([object()])
        await transport.start()
        await transport.send_bucket(bucket)
        await transport.finish(1)
        await transport.close()

    try:
        asyncio.run(publish())
    finally:
        pool.release()
    assert calls[-2:] == ["update_weights", "finish_weight_update"]
    assert transport.timings == {
        "pack": WRITE_SECONDS,
        "wait_load": ENGINE_SECONDS["update_weights"],  # one bucket: loaded while finish drains it
        "finish": ENGINE_SECONDS["finish_weight_update"],
    }
