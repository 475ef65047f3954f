"""Worker process of the multi-rank MoE router-loss test (spawned by dist_workers.spawn)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from tests.integration.trainer.hand_batch import hand_batch, hand_config

AUX_COEFF = 0.5  # large enough that a wrong weight of the router term shows above the fp32 noise


def router_loss_config(checkpoint: str, storage: str, tp: int = 1, world_size: int = 1, **overrides):
    """The hand config with the load-balancing loss on, at (TP=tp, DP=world_size/tp); `overrides`:
    further fields (the EP tests' expert_model_parallel_size)."""
    return hand_config(
        Path(checkpoint),
        Path(storage),
        moe_aux_loss_coeff=AUX_COEFF,
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=world_size,
        colocate=False,
        rollout_num_gpus=1,
        **overrides,
    )


def train_with_aux_loss_and_dump(
    rank: int, world_size: int, port: int, tp: int, checkpoint: str, storage: str, out: str
) -> None:
    """Train two rollouts of the hand batch with the aux loss; dump the metrics and the HF weights."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from vime_core.trainer.parallel import destroy_parallel
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = router_loss_config(checkpoint, storage, tp, world_size)
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    metrics = [trainer.train(k, hand_batch()) for k in range(2)]
    torch.save({"metrics": metrics, "hf": dict(trainer.iter_hf_weights())}, Path(out) / f"rank{rank}.pt")
    destroy_parallel()
