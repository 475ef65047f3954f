"""Worker processes of the multi-rank trainer tests (spawned with torch.multiprocessing)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch


def spawn(worker: Callable, world_size: int, *args) -> None:
    """Run ``worker(rank, world_size, port, *args)`` in ``world_size`` processes over gloo."""
    import torch.multiprocessing as mp

    from vime_core.trainer.parallel import free_port

    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # two ranks share the machine's cores; children inherit it
    try:
        mp.spawn(worker, args=(world_size, free_port(), *args), nprocs=world_size, join=True)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = previous


def tp_trainer(rank: int, world_size: int, port: int, tp: int, checkpoint: str, storage: str):
    """In a spawned worker: this rank's MegatronTrainer of the hand config at (TP=tp,
    DP=world/tp), initialised from ``checkpoint`` (warnings off, one thread: ranks share cores)."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests.integration.trainer.hand_batch import hand_config
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = hand_config(
        Path(checkpoint),
        Path(storage),
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=world_size,
        colocate=False,
        rollout_num_gpus=1,
    )
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    return trainer


def train_and_dump(rank: int, world_size: int, port: int, tp: int, checkpoint: str, storage: str, out: str) -> None:
    """Train two rollouts of the hand batch at (TP=tp, DP=world/tp); dump losses, this rank's
    HF-gathered weights and its local parameters."""
    from tests.integration.trainer.hand_batch import hand_batch
    from vime_core.trainer.hf_convert import read_hf_safetensors

    trainer = tp_trainer(rank, world_size, port, tp, checkpoint, storage)
    source = read_hf_safetensors(checkpoint)
    gathered = list(trainer.iter_hf_weights())  # whole: a short-circuit would desync the TP gathers
    round_trip_exact = all(torch.equal(t, source[n]) for n, t in gathered)
    losses = [trainer.train(k, hand_batch())["loss"] for k in range(2)]
    result = {
        "round_trip_exact": round_trip_exact,
        "losses": losses,
        "hf": {n: t.clone() for n, t in trainer.iter_hf_weights()},
        "local": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "log_probs": trainer.compute_log_probs(hand_batch()),
    }
    torch.save(result, Path(out) / f"rank{rank}.pt")
    from vime_core.trainer.parallel import destroy_parallel

    destroy_parallel()


def train_ppo_and_dump(rank: int, world_size: int, port: int, tp: int, checkpoint: str, storage: str, out: str) -> None:
    """Train three rollouts of the hand batch with ppo at (TP=tp, DP=world/tp); dump each
    rollout's metrics and the critic's values of the hand batch afterwards."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests.integration.trainer.hand_batch import hand_batch, hand_config
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = hand_config(
        Path(checkpoint),
        Path(storage),
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=world_size,
        colocate=False,
        rollout_num_gpus=1,
        advantage_estimator="ppo",
        critic_lr=1e-3,
    )
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    metrics = [trainer.train(k, hand_batch()) for k in range(3)]
    values = trainer.critic.values(hand_batch(), [[0, 1, 2, 3]])
    torch.save({"metrics": metrics, "values": values}, Path(out) / f"rank{rank}.pt")
    from vime_core.trainer.parallel import destroy_parallel

    destroy_parallel()
