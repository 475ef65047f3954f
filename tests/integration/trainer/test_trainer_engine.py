"""The trainer against a real vLLM CPU engine: the engine starts on the trainer's HF export and
serves exactly the trained weights; after another step, publish() publishes version 1 and
the engine's log-probs follow the trainer's again."""

from __future__ import annotations

import pytest

from tests.integration.publish.conftest import LOGPROB_ATOL, PROMPT, engine_call, engine_sample
from tests.integration.trainer.hand_batch import hand_batch, hand_config


def _trainer_log_probs(trainer, prompt: list[int], tokens: list[int]) -> list[float]:
    batch = {"tokens": [prompt + tokens], "response_length": [len(tokens)], "loss_mask": [[1] * len(tokens)]}
    return trainer.compute_log_probs(batch)[0]


@pytest.mark.slow
def test_export_serves_in_vllm_and_publish_sends_the_weights(
    single_rank, tiny_model_dir, vllm_python, cache_dir, tmp_path
):
    from vime_core.engines.server import EngineServer
    from vime_core.trainer.trainer import MegatronTrainer
    from vime_core.weight_sync.publish_loop import PublishLoop

    cfg = hand_config(
        tiny_model_dir,
        tmp_path,
        num_steps_per_rollout=1,
        lr=1e-2,
        vllm_python=vllm_python,
        rollout_max_context_len=128,
        update_weight_buffer_size=64 * 1024,
    )
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    trainer.train(0, hand_batch())
    export = trainer.export_hf(str(tmp_path / "export"))

    server = EngineServer(cfg, 0, model_path=export, log_dir=str(cache_dir / "engine-logs"))
    try:
        server.start()
        tokens, engine_lp, _ = engine_sample(server, PROMPT, seed=1)
        assert engine_lp == pytest.approx(_trainer_log_probs(trainer, PROMPT, tokens), abs=LOGPROB_ATOL)

        trainer.train(1, hand_batch())
        moved = _trainer_log_probs(trainer, PROMPT, tokens)
        assert max(abs(a - b) for a, b in zip(moved, engine_lp)) > 10 * LOGPROB_ATOL  # the step mattered
        # no RolloutManager to ask the run's token from (cluster/engine_token.py): give it the engine's
        trainer._publisher = PublishLoop(token=server.auth_token)
        stats = trainer.publish([server.url])
        assert trainer.weight_version == 1 and stats["version"] == 1
        assert engine_call(server, "weight_version") == 1
        tokens, engine_lp, spans = engine_sample(server, PROMPT, seed=2)
        assert engine_lp == pytest.approx(_trainer_log_probs(trainer, PROMPT, tokens), abs=LOGPROB_ATOL)
        assert {int(s["version"]) for s in spans} == {1}  # spans carry the version as a string
    finally:
        server.shutdown()
