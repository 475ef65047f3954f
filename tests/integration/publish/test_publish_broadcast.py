"""The `gloo` broadcast transport against a real vLLM CPU server started with vime's
`vime_broadcast` backend: the engine's worker joins the trainer's group, every bucket is one
broadcast, the served log-probs equal a transformers forward of the published weights, the
group is kept between one publisher's publishes, and a new publisher (a rebuilt trainer) forms
a new one that the engine switches to. NCCL is the same code over another carrier; it needs
two GPUs (bench/gpu/)."""

from __future__ import annotations

import pytest

from tests.integration.publish.conftest import assert_serves, engine_call, make_cfg, perturbed, started_engine

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def broadcast_engine(tiny_model_dir, vllm_python, cache_dir):
    cfg = make_cfg(tiny_model_dir, vllm_python, weight_transport="gloo")
    with started_engine(cfg, cache_dir / "engine-logs-broadcast") as server:
        yield server


def publish(engine, weights, version, publisher):
    from vime_core.weight_sync.publish import publish_weights

    cfg = make_cfg(engine.model_path, engine.cfg.vllm_python, weight_transport="gloo")
    return publish_weights(
        weights.items(), [engine.url], version, cfg, initial_version=0, loop=publisher, token=engine.auth_token
    )


def test_gloo_publishes_keep_one_group_and_a_new_publisher_forms_another(
    broadcast_engine, tiny_model_dir, base_weights
):
    from vime_core.weight_sync.publish_loop import PublishLoop

    engine = broadcast_engine
    assert "vime_broadcast" in " ".join(engine.command(engine.port))
    trainer = PublishLoop()
    try:
        first = perturbed(base_weights, seed=21)
        stats = publish(engine, first, 1, trainer)
        assert stats["transport"] == "gloo" and "form_group" in stats["transport_seconds"]
        assert_serves(engine, tiny_model_dir, first, 1)
        [worker] = engine_call(engine, "collective_rpc", "vime_update_stats")
        assert worker["buckets"] == stats["buckets"] > 1 and worker["bytes"] == stats["bytes"]
        [group] = engine_call(engine, "collective_rpc", "vime_broadcast_group_id")
        assert group == trainer.broadcast_group("gloo").group_id

        second = perturbed(base_weights, seed=22)
        stats = publish(engine, second, 2, trainer)
        assert "form_group" not in stats["transport_seconds"]  # the same group, no new rendezvous
        assert_serves(engine, tiny_model_dir, second, 2)
    finally:
        trainer.close()

    rebuilt = PublishLoop()  # a trainer rebuilt after a failure knows no group
    try:
        third = perturbed(base_weights, seed=23)
        stats = publish(engine, third, 3, rebuilt)
        assert "form_group" in stats["transport_seconds"]
        assert_serves(engine, tiny_model_dir, third, 3)
        assert (
            engine_call(engine, "collective_rpc", "vime_broadcast_group_id")
            == [rebuilt.broadcast_group("gloo").group_id]
            != [group]
        )
    finally:
        rebuilt.close()


def test_gloo_bucket_changed_in_transit_is_refused_and_publishing_again_repairs(
    broadcast_engine, tiny_model_dir, base_weights, monkeypatch
):
    """The trainer's end of the group flips one bit of the first bucket after summing it: the worker
    refuses the bucket, the group is dropped, and the next publish forms a new one and serves."""
    from vime_core.weight_sync.publish import PublishError
    from vime_core.weight_sync.publish_loop import PublishLoop
    from vime_core.wire.broadcast_group import GlooGroup

    engine = broadcast_engine
    send = GlooGroup.broadcast
    flipped = []

    def flip_then_send(self, buffer):
        if not flipped:
            buffer[0] ^= 0x01
            flipped.append(True)
        send(self, buffer)

    monkeypatch.setattr(GlooGroup, "broadcast", flip_then_send)  # in this process: rank 0, the sender
    version = engine_call(engine, "weight_version")
    trainer = PublishLoop()
    try:
        with pytest.raises(PublishError, match="checksum") as err:
            publish(engine, perturbed(base_weights, seed=24), version + 1, trainer)
        assert err.value.bytes_moved and trainer.broadcast_group("gloo") is None
        assert engine_call(engine, "weight_version") == version

        monkeypatch.undo()
        repaired = perturbed(base_weights, seed=25)
        stats = publish(engine, repaired, version + 1, trainer)
        assert "form_group" in stats["transport_seconds"]
        assert_serves(engine, tiny_model_dir, repaired, version + 1)
    finally:
        trainer.close()
