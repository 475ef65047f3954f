"""publish_weights' protocol against stub engines (the real server is in
tests/integration/publish): order of control calls, flush decision, what the engine receives
through shared memory, and what happens on each kind of failure."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from vime_core.weight_sync.publish import PublishError, publish_weights
from vime_core.weight_sync.weight_spec import WeightSpecError

SERVED = "bfloat16"


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(19, 32, generator=g),
        "model.layers.0.mlp.up_proj.weight": torch.randn(64, 32, generator=g),
        "model.layers.0.mlp.down_proj.weight": torch.randn(32, 64, generator=g),
        "model.norm.weight": torch.randn(32, generator=g),
    }


def spec_of(w: dict) -> dict:
    return {
        "source": "stub",
        "served_dtype": SERVED,
        "tensors": {n: {"shape": list(t.shape), "dtype": SERVED} for n, t in w.items()},
    }


class StubEngine:
    """Records control calls; loads shm buckets by reading the files as the vLLM side does."""

    def __init__(
        self,
        url: str,
        spec: dict,
        fail_on_update: int | None = None,
        sets_version: bool = True,
        fail_pause: bool = False,
    ) -> None:
        self.name = url
        self.spec = spec
        self.calls: list[tuple] = []
        self.loaded: dict[str, torch.Tensor] = {}
        self.version = 0
        self.fail_on_update = fail_on_update
        self.sets_version = sets_version
        self.updates = 0
        self.fail_pause = fail_pause

    async def collective_rpc(self, method, kwargs=None, args=None, timeout_s=None):
        self.calls.append(("collective_rpc", method))
        return [self.spec]

    async def pause(self, mode):
        self.calls.append(("pause", mode))
        if self.fail_pause:
            raise RuntimeError("pause refused")

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    async def resume(self):
        self.calls.append(("resume",))

    async def init_weight_transfer(self, info):
        self.calls.append(("init_weight_transfer", info))

    async def start_weight_update(self):
        self.calls.append(("start_weight_update",))

    async def update_weights(self, info):
        self.calls.append(("update_weights",))
        self.updates += 1
        if self.fail_on_update == self.updates:
            raise RuntimeError("engine died")
        with open(info["path"], "rb") as f:
            flat = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        for name, dtype, shape, off in zip(info["names"], info["dtype_names"], info["shapes"], info["offsets"]):
            dt = getattr(torch, dtype)
            n = dt.itemsize * torch.Size(shape).numel()
            self.loaded[name] = flat[off : off + n].view(dt).view(shape).clone()

    async def finish_weight_update(self, version):
        self.calls.append(("finish_weight_update", version))
        if self.sets_version:
            self.version = version

    async def request(self, method, path, json=None, **kw):
        self.calls.append(("request", path, json))

    async def weight_version(self):
        return self.version

    async def aclose(self):
        pass

    def names(self) -> list[str]:
        return [c[0] if c[0] != "collective_rpc" else f"rpc:{c[1]}" for c in self.calls]


@pytest.fixture
def publisher():
    """What a trainer keeps between its publishes (engine clients, bucket pools); closed after."""
    from vime_core.weight_sync.publish_loop import PublishLoop

    loop = PublishLoop()
    yield loop
    loop.close()


def make_cfg(**overrides):
    from vime_core.config import make_config

    return make_config({"update_weight_buffer_size": 2048, **overrides})


def run_publish(w, engines, version, tmp_path, publisher=None, **cfg_overrides):
    by_url = {e.name: e for e in engines}
    return publish_weights(
        w.items(),
        list(by_url),
        version,
        make_cfg(**cfg_overrides),
        initial_version=0,
        shm_dir=str(tmp_path),
        client_factory=by_url.__getitem__,
        loop=publisher,
    )


def test_first_publish_flushes_and_every_engine_gets_bf16_copies_of_every_tensor(tmp_path, publisher):
    w = weights()
    engines = [StubEngine(f"http://e{i}", spec_of(w)) for i in range(2)]
    stats = run_publish(w, engines, 1, tmp_path, publisher)
    for e in engines:
        assert e.names() == [
            "rpc:vime_weight_spec",
            "init_weight_transfer",
            "pause",
            "reset_prefix_cache",
            "start_weight_update",
        ] + ["update_weights"] * stats["buckets"] + ["finish_weight_update", "resume"]
        assert ("pause", "abort") in e.calls and ("finish_weight_update", 1) in e.calls
        assert set(e.loaded) == set(w)
        for name, t in w.items():
            assert torch.equal(e.loaded[name], t.to(torch.bfloat16))
    total = sum(t.numel() * 2 for t in w.values())
    assert stats["bytes"] == total and stats["flushed"] is True and stats["version"] == 1
    assert stats["buckets"] > 1  # 2 KiB buckets
    files = sorted(os.listdir(tmp_path))
    assert len(files) == stats["buckets"]  # one pool file per bucket slot, kept for the next publish
    inodes = {f: os.stat(tmp_path / f).st_ino for f in files}
    run_publish(weights(1), engines, 2, tmp_path, publisher)
    assert {f: os.stat(tmp_path / f).st_ino for f in os.listdir(tmp_path)} == inodes  # reused, not re-made
    assert all(torch.equal(engines[0].loaded[n], t.to(torch.bfloat16)) for n, t in weights(1).items())


def test_a_version_between_flushes_pauses_with_keep_and_keeps_the_cache(tmp_path):
    w = weights()
    engine = StubEngine("http://e0", spec_of(w))
    stats = run_publish(w, [engine], 2, tmp_path, flush_cache_interval=3)
    assert stats["flushed"] is False
    assert ("pause", "keep") in engine.calls and ("reset_prefix_cache",) not in engine.calls


def test_validation_failure_touches_no_engine(tmp_path):
    w = weights()
    engine = StubEngine("http://e0", spec_of(w))
    bad = {**w, "model.norm.weight": torch.ones(33)}
    with pytest.raises(WeightSpecError, match=r"model\.norm\.weight.*\[33\].*\[32\]"):
        run_publish(bad, [engine], 1, tmp_path)
    # only the spec was read (and the transport's handshake, which changes nothing)
    assert set(engine.names()) <= {"rpc:vime_weight_spec", "init_weight_transfer"}
    assert run_publish(w, [engine], 1, tmp_path)["version"] == 1  # nothing left locked or half-done


def test_failure_after_bytes_moved_closes_the_session_leaves_engines_paused_and_says_so(tmp_path, publisher):
    w = weights()
    engine = StubEngine("http://e0", spec_of(w), fail_on_update=2)
    with pytest.raises(PublishError, match="half-applied") as err:
        run_publish(w, [engine], 1, tmp_path, publisher)
    assert err.value.bytes_moved is True
    assert ("resume",) not in engine.calls and engine.version == 0
    # closed with no version (a session opened over an open one fails in vLLM), so the engine dropped
    # its mappings of the pool's files
    assert engine.calls[-1] == ("request", "/finish_weight_update", {})
    assert publisher.shm_pool(str(tmp_path)).clean is True
    healthy = StubEngine("http://e0", spec_of(w))
    run_publish(w, [healthy], 2, tmp_path, publisher)
    assert publisher.shm_pool(str(tmp_path)).clean is True and set(healthy.loaded) == set(w)


def test_the_publisher_keeps_its_bucket_files_between_publishes_and_gives_them_back_when_closed(tmp_path, publisher):
    from vime_core.wire.shm_format import FILE_PREFIX

    def files() -> set[str]:
        return {p.name for p in tmp_path.glob(FILE_PREFIX + "*")}

    w = weights()
    run_publish(w, [StubEngine("http://e0", spec_of(w))], 1, tmp_path)  # no publisher: a pool for the call
    assert files() == set()
    run_publish(w, [StubEngine("http://e0", spec_of(w))], 1, tmp_path, publisher)
    kept = files()
    assert kept == {os.path.basename(p) for p in publisher.shm_pool(str(tmp_path)).paths()} and kept
    run_publish(w, [StubEngine("http://e0", spec_of(w))], 2, tmp_path, publisher)
    assert files() == kept  # the same slot files, rewritten
    publisher.close()
    assert files() == set()


def test_failure_before_bytes_moved_closes_the_empty_session_and_resumes(tmp_path, monkeypatch):
    import vime_core.weight_sync.transport.shm as shm

    def broken(*a, **k):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(shm, "write_bucket_file", broken)
    w = weights()
    engine = StubEngine("http://e0", spec_of(w))
    with pytest.raises(OSError, match="simulated"):
        run_publish(w, [engine], 1, tmp_path)
    assert engine.names()[-2:] == ["request", "resume"]
    assert ("request", "/finish_weight_update", {}) in engine.calls  # no version set
    assert engine.version == 0


def test_an_engine_failing_to_pause_leaves_no_engine_paused(tmp_path):
    w = weights()
    engines = [StubEngine("http://e0", spec_of(w)), StubEngine("http://e1", spec_of(w), fail_pause=True)]
    with pytest.raises(RuntimeError, match="pause refused"):
        run_publish(w, engines, 1, tmp_path)
    for e in engines:
        assert e.names()[-1] == "resume" and "start_weight_update" not in e.names()


def test_an_engine_that_does_not_report_the_new_version_is_an_error(tmp_path):
    w = weights()
    engine = StubEngine("http://e0", spec_of(w), sets_version=False)
    with pytest.raises(PublishError, match="http://e0 reports 0"):
        run_publish(w, [engine], 1, tmp_path)


def test_engines_serving_different_dtypes_are_refused(tmp_path):
    w = weights()
    other = spec_of(w)
    other["tensors"] = {n: {**e, "dtype": "float32"} for n, e in other["tensors"].items()}
    engines = [StubEngine("http://e0", spec_of(w)), StubEngine("http://e1", other)]
    with pytest.raises(PublishError, match="other dtypes"):
        run_publish(w, engines, 1, tmp_path)


def test_version_must_move_forward_and_urls_must_be_given(tmp_path):
    w = weights()
    with pytest.raises(ValueError, match="new_version"):
        run_publish(w, [StubEngine("http://e0", spec_of(w))], 0, tmp_path)
    with pytest.raises(ValueError, match="engine_urls"):
        publish_weights(w.items(), [], 1, make_cfg())


def test_publish_runs_inside_a_running_event_loop(tmp_path):
    """The trainer may call it from an async Ray actor."""
    w = weights()
    engine = StubEngine("http://e0", spec_of(w))

    async def caller():
        return run_publish(w, [engine], 1, tmp_path)

    assert asyncio.run(caller())["version"] == 1
