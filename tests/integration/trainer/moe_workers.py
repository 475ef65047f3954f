"""Worker process of the multi-rank MoE trainer test (spawned by dist_workers.spawn)."""

from __future__ import annotations

from pathlib import Path

import torch


def train_moe_and_dump(rank: int, world_size: int, port: int, tp: int, checkpoint: str, storage: str, out: str) -> None:
    """Train two rollouts of the hand batch at (TP=tp, DP=world/tp); dump the losses and grad
    norms, the HF-gathered weights, the local parameters and the log-probs after training."""
    from tests.integration.trainer.dist_workers import tp_trainer
    from tests.integration.trainer.hand_batch import hand_batch
    from vime_core.trainer.hf_convert import read_hf_safetensors
    from vime_core.trainer.parallel import destroy_parallel

    trainer = tp_trainer(rank, world_size, port, tp, checkpoint, storage)
    source = read_hf_safetensors(checkpoint)
    gathered = list(trainer.iter_hf_weights())  # whole: a short-circuit would desync the TP gathers
    round_trip_exact = all(torch.equal(t, source[n]) for n, t in gathered)  # before training: some are views
    metrics = [trainer.train(k, hand_batch()) for k in range(2)]
    result = {
        "round_trip_exact": round_trip_exact,
        "losses": [m["loss"] for m in metrics],
        "grad_norms": [m["grad_norm"] for m in metrics],
        "hf": {n: t.clone() for n, t in trainer.iter_hf_weights()},
        "local": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "log_probs": trainer.compute_log_probs(hand_batch()),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    destroy_parallel()
