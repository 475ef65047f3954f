"""Top-k / top-p against a real vLLM CPU engine serving the trainer's own weights (its HF
export): the engine's processed log-probs (after temperature and its top-k / top-p
renormalisation) and the trainer's of the same tokens give token weights exp(trainer - engine)
of 1 within fp32 tolerance, on 500-token responses, for top-p, top-k and both; scored over the
whole tempered softmax (the trainer before top-k / top-p were applied) they do not.

The measured weights are printed (``pytest -s``): mean token weight and the sequence weight
exp(sum of the differences), with the truncation and without it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.publish.conftest import engine_call
from tests.integration.trainer.hand_batch import hand_config
from vime_core.trainer.truncation import Sampling

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]
NEW_TOKENS = 500  # the tiny model has 512 positions
TEMPERATURE = 0.8
# fp32 engine vs fp32 trainer on the same weights: kernels differ in summation order only
TOKEN_ATOL = 1e-4


def _engine_sample(server, sampling: Sampling, seed: int) -> tuple[list[int], list[float]]:
    params = {
        "max_tokens": NEW_TOKENS,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "logprobs": 0,
        "ignore_eos": True,
        "seed": seed,
    }
    choice = engine_call(server, "generate", PROMPT, params)["choices"][0]
    return choice["token_ids"], [c["logprob"] for c in choice["logprobs"]["content"]]


def _trainer_log_probs(trainer, tokens: list[int], sampling) -> torch.Tensor:
    from vime_core.trainer.train_step import forward_log_probs

    return forward_log_probs(trainer.model, _batch(tokens), [[0]], trainer.arch.vocab_size, sampling, trainer.device)[0]


def _batch(tokens: list[int]) -> dict[str, list]:
    return {"tokens": [PROMPT + tokens], "response_length": [len(tokens)], "loss_mask": [[1] * len(tokens)]}


def _weights(diff: torch.Tensor) -> tuple[float, float]:
    """(mean token weight, sequence weight) of per-token log-ratios trainer - engine."""
    return float(diff.double().exp().mean()), math.exp(float(diff.double().sum()))


@pytest.mark.slow
def test_trainer_scores_the_distribution_the_engine_sampled_from(
    single_rank, tiny_model_dir, vllm_python, cache_dir, tmp_path
):
    from vime_core.engines.server import EngineServer
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = hand_config(
        tiny_model_dir,
        tmp_path,
        vllm_python=vllm_python,
        rollout_max_context_len=512,
        rollout_temperature=TEMPERATURE,
        rollout_top_p=0.9,
        rollout_top_k=6,
    )
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    server = EngineServer(
        cfg, 0, model_path=trainer.export_hf(str(tmp_path / "export")), log_dir=str(cache_dir / "engine-logs")
    )
    try:
        server.start()
        settings = {
            "top_p 0.9": Sampling(TEMPERATURE, top_p=0.9),
            "top_k 6": Sampling(TEMPERATURE, top_k=6),
            "top_k 6, top_p 0.9": Sampling.of(cfg),
        }
        for seed, (name, sampling) in enumerate(settings.items()):
            tokens, engine_lp = _engine_sample(server, sampling, seed)
            assert len(tokens) == NEW_TOKENS
            engine_lp = torch.tensor(engine_lp)
            if sampling == Sampling.of(cfg):  # the trainer's own entry point, at the configuration's sampling
                ours = torch.tensor(trainer.compute_log_probs(_batch(tokens))[0])
            else:
                ours = _trainer_log_probs(trainer, tokens, sampling)
            untruncated = _trainer_log_probs(trainer, tokens, TEMPERATURE)
            mean, sequence = _weights(ours - engine_lp)
            before_mean, before_sequence = _weights(untruncated - engine_lp)
            print(
                f"\n{name}, T {TEMPERATURE}, {NEW_TOKENS} tokens: mean token weight {mean:.6f}, sequence "
                f"weight {sequence:.6f}, max |log-ratio| {float((ours - engine_lp).abs().max()):.2e}; "
                f"over the full softmax: mean {before_mean:.4f}, sequence {before_sequence:.3e}"
            )
            assert float((ours - engine_lp).abs().max()) < TOKEN_ATOL
            assert abs(mean - 1) < TOKEN_ATOL and abs(sequence - 1) < NEW_TOKENS * TOKEN_ATOL
            assert before_mean < 0.97 and before_sequence < 1e-3  # what top-k / top-p did to the weights
    finally:
        server.shutdown()
