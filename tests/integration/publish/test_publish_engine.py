"""publish_weights against a real vLLM CPU server: versions, flushes, log-probs after the
update, refused updates that leave the old weights serving, and the disk fallback.

The tests share one server and run in any order: the first publish (from version 0) is made by
a module fixture before any test, and every other test starts from the version the engine holds.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.publish.conftest import (
    LOGPROB_ATOL,
    PROMPT,
    assert_serves,
    check_served,
    engine_call,
    engine_sample,
    hf_logprobs,
    make_cfg,
    perturbed,
    served,
)

pytestmark = pytest.mark.slow


def publish(engine, weights: dict, version: int, **cfg_overrides) -> dict:
    from vime_core.weight_sync.publish import publish_weights

    cfg = make_cfg(engine.model_path, engine.cfg.vllm_python, **cfg_overrides)
    return publish_weights(weights.items(), [engine.url], version, cfg, initial_version=0, token=engine.auth_token)


@pytest.fixture(scope="module", autouse=True)
def first_publish(publish_engine, base_weights) -> dict:
    """The first publish to the engine as it started (version 0), before any test of the module
    whichever runs first: what the engine served before and right after it."""
    new = perturbed(base_weights, seed=1)
    before = served(publish_engine)  # also fills the prefix cache
    stats = publish(publish_engine, new, 1)
    return {"new": new, "before": before, "stats": stats, "after": served(publish_engine)}


def test_first_publish_is_version_1_flushes_and_serves_new_weights(first_publish, tiny_model_dir, base_weights):
    new, stats = first_publish["new"], first_publish["stats"]
    check_served(first_publish["before"], tiny_model_dir, base_weights, 0)
    tokens = first_publish["before"][0]
    moved = (
        (hf_logprobs(tiny_model_dir, new, PROMPT, tokens) - hf_logprobs(tiny_model_dir, base_weights, PROMPT, tokens))
        .abs()
        .max()
    )
    assert moved > 10 * LOGPROB_ATOL  # the noise is visible in the log-probs

    assert stats["version"] == 1 and stats["flushed"] is True and stats["transport"] == "shm"
    total_bytes = sum(t.numel() * 4 for t in new.values())  # fp32 engine: fp32 on the wire
    assert stats["bytes"] == total_bytes
    assert stats["buckets"] >= -(-total_bytes // (64 * 1024))  # 64 KiB buckets (make_cfg)
    assert set(stats["seconds"]) >= {"validate", "pause", "transfer", "finish", "resume", "verify", "total"}
    check_served(first_publish["after"], tiny_model_dir, new, 1)  # the cached prompt prefix was flushed


def test_publish_without_flush_keeps_requests_and_updates(publish_engine, tiny_model_dir, base_weights):
    new = perturbed(base_weights, seed=2)
    version = engine_call(publish_engine, "weight_version") + 1  # >= 2: the first publish was made
    # interval = version: not a flush version ((version - 0 - 1) % version != 0); 2 and 2 in file order
    stats = publish(publish_engine, new, version, flush_cache_interval=version)
    assert stats["flushed"] is False
    assert engine_call(publish_engine, "weight_version") == version
    engine_call(publish_engine, "reset_prefix_cache")  # not flushed above, by design
    assert_serves(publish_engine, tiny_model_dir, new, version)


def _shape_mismatch(w):
    name = "model.layers.0.mlp.up_proj.weight"
    return {**w, name: w[name][:-1]}, name


def _unknown_name(w):
    return {
        **w,
        "model.layers.99.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"],
    }, "model.layers.99.mlp.up_proj.weight"


def _missing(w):
    name = "model.layers.1.self_attn.o_proj.weight"
    return {k: v for k, v in w.items() if k != name}, name


def _int_dtype(w):
    name = "model.norm.weight"
    return {**w, name: w[name].to(torch.int32)}, name


@pytest.mark.parametrize(
    "corrupt", [_shape_mismatch, _unknown_name, _missing, _int_dtype], ids=lambda f: f.__name__.strip("_")
)
def test_bad_publish_is_refused_and_old_weights_keep_serving(publish_engine, base_weights, corrupt):
    from vime_core.weight_sync.weight_spec import WeightSpecError

    version = engine_call(publish_engine, "weight_version")
    before = engine_sample(publish_engine, seed=7)
    bad, culprit = corrupt(perturbed(base_weights, seed=3))
    with pytest.raises(WeightSpecError, match=culprit.replace(".", r"\.")) as err:
        publish(publish_engine, bad, version + 1)
    assert publish_engine.url in str(err.value)
    assert engine_call(publish_engine, "is_paused") is False
    assert engine_call(publish_engine, "weight_version") == version
    assert engine_sample(publish_engine, seed=7) == before  # same weights: same tokens, same log-probs


def test_failure_after_session_start_restores_old_weights(publish_engine, base_weights, monkeypatch):
    """A bucket that fails to pack after the engine opened its session: nothing loaded, the
    empty session is closed (vLLM restores every layer) and generation resumes on the old weights."""
    import vime_core.weight_sync.transport.shm as shm

    def broken_write(*args, **kwargs):
        raise OSError("no space left on the shared-memory device (simulated)")

    monkeypatch.setattr(shm, "write_bucket_file", broken_write)
    version = engine_call(publish_engine, "weight_version")
    before = engine_sample(publish_engine, seed=11)
    with pytest.raises(OSError, match="simulated"):
        publish(publish_engine, perturbed(base_weights, seed=4), version + 1)
    assert engine_call(publish_engine, "is_paused") is False
    assert engine_call(publish_engine, "weight_version") == version
    assert engine_sample(publish_engine, seed=11) == before


def test_disk_fallback_publishes_a_new_version(publish_engine, tiny_model_dir, base_weights):
    version = engine_call(publish_engine, "weight_version")
    new = perturbed(base_weights, seed=5)
    stats = publish(publish_engine, new, version + 1, weight_transport="disk")
    assert stats["transport"] == "disk" and stats["flushed"] is True
    assert_serves(publish_engine, tiny_model_dir, new, version + 1)
    # and the session backend still works after a disk reload
    newer = perturbed(base_weights, seed=6)
    publish(publish_engine, newer, version + 2)
    assert_serves(publish_engine, tiny_model_dir, newer, version + 2)


def test_a_bucket_changed_in_transit_is_refused_and_publishing_again_repairs(
    publish_engine, tiny_model_dir, base_weights, monkeypatch
):
    """One bit of one tensor flipped in the shared-memory file after the trainer summed it: the
    worker's checksum refuses the bucket before loading it, the error names the tensor, and the
    next publish (what the sync's retry does) brings the engine to the trainer's weights."""
    import vime_core.weight_sync.transport.shm as shm
    from vime_core.weight_sync.publish import PublishError

    culprit = "model.layers.1.self_attn.o_proj.weight"
    write = shm.write_bucket_file

    def write_then_flip_a_bit(bucket, pool, checksums=True):
        info = write(bucket, pool, checksums)
        if culprit in info.names:
            with open(info.path, "r+b") as f:
                f.seek(info.offsets[info.names.index(culprit)])
                byte = f.read(1)[0]
                f.seek(-1, 1)
                f.write(bytes([byte ^ 0x01]))
        return info

    monkeypatch.setattr(shm, "write_bucket_file", write_then_flip_a_bit)
    version = engine_call(publish_engine, "weight_version")
    with pytest.raises(PublishError, match=culprit.replace(".", r"\.") + ".*none of it was loaded") as err:
        publish(publish_engine, perturbed(base_weights, seed=8), version + 1)
    assert err.value.bytes_moved and engine_call(publish_engine, "weight_version") == version

    monkeypatch.undo()
    repaired = perturbed(base_weights, seed=9)
    publish(publish_engine, repaired, version + 1)
    [worker] = engine_call(publish_engine, "collective_rpc", "vime_update_stats")
    assert worker["checked_tensors"] == worker["loaded_tensors"] == len(repaired)
    assert_serves(publish_engine, tiny_model_dir, repaired, version + 1)
