"""A hand-made rollout batch and configuration shared by the trainer tests and their workers."""

from __future__ import annotations

from pathlib import Path


def hand_batch(scale: float = 1.0) -> dict[str, list]:
    """Four samples (2 groups x 2) with different prompts/lengths; positive advantages on the
    first sample of each group, negative on the second; distinct response tokens per sample."""
    tokens = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 10, 11], [1, 4, 4, 12, 13, 14, 15], [1, 4, 4, 16, 17]]
    responses = [3, 2, 4, 2]
    return {
        "tokens": tokens,
        "response_length": responses,
        "total_length": [len(t) for t in tokens],
        "loss_mask": [[1] * r for r in responses],
        "advantage": [scale, -scale, scale, -scale],
        "reward": [scale, -scale, scale, -scale],
        "rollout_log_probs": [[-2.5] * r for r in responses],
    }


def hand_config(checkpoint: Path, storage: Path, **overrides):
    from vime_core.demo.settings import demo_config

    # Two optimizer steps per rollout: the second step's ratio is not 1, so the loss depends on
    # the weights, and old log-probs are recomputed (can_reuse_log_probs_in_loss is False).
    fields = dict(
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        num_steps_per_rollout=2,
        micro_batch_size=1,
        lr=1e-3,
        clip_grad=1.0,
        hf_checkpoint=str(checkpoint),
        storage_uri=str(storage),
        rollout_temperature=1.0,
        entropy_coef=0.0,  # the plain GRPO loss; the default job's entropy bonus is not under test here
    )
    fields.update(overrides)
    return demo_config(**fields)


def single_rank_trainer(cfg):
    """A MegatronTrainer of one rank, initialised from cfg.hf_checkpoint (with the single_rank
    fixture: the session's process group is reused)."""
    from vime_core.trainer.trainer import MegatronTrainer

    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    return trainer
