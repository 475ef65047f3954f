"""Worker of the two-rank non-finite step test (spawned with dist_workers.spawn)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import torch


def nan_on_one_rank_and_dump(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    checkpoint: str,
    storage: str,
    out: str,
    distributed_optimizer: bool = False,
) -> None:
    """Train rollout 0 (finite); on rollout 1 rank 1 alone finds a NaN in its gradient buffer
    after the gradients' reduction (what a TP rank sees of its own shard, and what no DP
    all-reduce would carry to the other rank); then rollout 2 (finite). Dumps each rollout's
    metrics and this rank's parameters before and after rollout 1 and after rollout 2.
    `distributed_optimizer`: Megatron's DistributedOptimizer (the GPU default), set past the
    configuration's device=cuda check (compat_cpu's shim runs it on CPU), where the reduction is a
    reduce-scatter and each rank steps its own shard of the main parameters."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests.integration.trainer.hand_batch import hand_batch, hand_config
    from vime_core.trainer.parallel import destroy_parallel
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = hand_config(
        Path(checkpoint),
        Path(storage),
        tensor_model_parallel_size=tp,
        actor_num_gpus_per_node=world_size,
        colocate=False,
        rollout_num_gpus=1,
        num_steps_per_rollout=1,
    )
    cfg.use_distributed_optimizer = distributed_optimizer
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()

    def params() -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    module = importlib.import_module("vime_core.trainer.train_step")  # patched where the step looks it up
    real_finalize = module.finalize_model_grads
    poison = {"on": False}

    def finalize_then_poison(models, *args, **kwargs):
        result = real_finalize(models, *args, **kwargs)
        if poison["on"] and rank == 1:
            models[0].buffers[0].grad_data[0] = math.nan
        return result

    module.finalize_model_grads = finalize_then_poison
    metrics = [trainer.train(0, hand_batch())]
    before = params()
    poison["on"] = True
    metrics.append(trainer.train(1, hand_batch()))
    poison["on"] = False
    after_skip = params()
    metrics.append(trainer.train(2, hand_batch()))
    torch.save(
        {
            "metrics": metrics,
            "before": before,
            "after_skip": after_skip,
            "after_next": params(),
            "optimizer_steps": trainer.optimizer_steps,
        },
        Path(out) / f"rank{rank}.pt",
    )
    destroy_parallel()
