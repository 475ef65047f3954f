"""The advantages train_on_rollout hands its steps, at DP=1 (in the test's process) and DP=2 (two
processes over gloo), with the forwards, the critic and the optimizer steps replaced by
deterministic stand-ins: what differs between the two layouts is only where the whitening's sums
come from.

The batch: 8 groups of 2 samples, two optimizer steps of 8 samples. Groups 0, 1, 4 and 5 have flat
rewards, 2, 3, 6 and 7 mixed ones, so that at DP=2 rank 0 holds only flat groups in both steps (the
issue's layout); samples 1, 6, 9 and 14 have a tool span (loss mask 0, placeholder log-prob 0.0).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import torch

ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
FLAT_GROUPS = {0, 1, 4, 5}
TOOL_SAMPLES = {1, 6, 9, 14}
GROUPS, PER_GROUP = 8, 2


def config(estimator: str):
    from vime_core.config import load_config

    return load_config(
        overrides={
            "advantage_estimator": estimator,
            "rollout_batch_size": GROUPS,
            "n_samples_per_prompt": PER_GROUP,
            "num_steps_per_rollout": 2,
            "micro_batch_size": 2,
            "kl_coef": 0.05,
            "kl_loss_type": "k1",
            "gamma": 0.95,
            **({"lambd": 0.9} if estimator == "ppo" else {}),  # GAE's: the others refuse it
        }
    )


def batch(cfg) -> dict:
    from vime_core.data.batch import build_batch
    from vime_core.data.sample import Sample, Status

    samples = []
    for group in range(GROUPS):
        for index in range(PER_GROUP):
            n = len(samples)
            # flat: both 1 (even groups) or both 0 (odd); mixed: 1 then 0
            reward = float(group % 2 == 0) if group in FLAT_GROUPS else float(index == 0)
            s = Sample(
                prompt_id=f"p{group}",
                tokens=[1, 2, 3],
                prompt_length=3,
                group_index=group,
                index=index,
                session_id=f"s{n}",
                status=Status.COMPLETED,
                finish_reason="stop",
                reward=reward,
            )
            s.append_response_tokens([10 + t for t in range(3 + n % 4)], [-0.5] * (3 + n % 4))
            if n in TOOL_SAMPLES:
                s.append_response_tokens([7, 8, 9], [0.0] * 3, loss_mask_value=0)
                s.append_response_tokens([11, 12], [-0.4, -0.6])
            samples.append(s)
    return build_batch(samples, cfg)


def _per_token(model: str, i: int, length: int) -> torch.Tensor:
    """Log-probs of sample i that depend on the sample only, never on the layout; the reference's
    differ from the policy's by noise of 0.05 (so the KL penalty is noise of ~kl_coef * 0.05)."""
    policy = -1.0 - torch.rand(length, generator=torch.Generator().manual_seed(7919 * i))
    if model == "policy":
        return policy
    return policy + 0.05 * torch.randn(length, generator=torch.Generator().manual_seed(7919 * i + 1))


class _Critic:
    """V_old from the sample index; its step records the returns it was given."""

    def __init__(self, returns: dict):
        self.returns = returns

    def values(self, batch, micro_batches):
        out = {}
        for mb in micro_batches:
            for i in mb:
                g = torch.Generator().manual_seed(104729 + i)
                out[i] = torch.rand(int(batch["response_length"][i]), generator=g)
        return out

    def train_step(self, batch, micro_batches, denominators, returns, old_values, dp_size, dp_group):
        self.returns.update({i: returns[i].clone() for mb in micro_batches for i in mb})
        return {"critic_lr": 0.0, "value_loss": 0.0}


@contextlib.contextmanager
def _stand_ins(advantages: dict):
    from vime_core.trainer import rollout_training as train_step  # patched where train_on_rollout looks them up

    def forward_log_probs(model, batch, micro_batches, vocab, temperature, device, replay=False):
        return {i: _per_token(model, i, int(batch["response_length"][i])) for mb in micro_batches for i in mb}

    def step(model, optimizer, inputs, *args, **kwargs):
        advantages.update({i: inputs.advantages[i].clone() for mb in inputs.micro_batches for i in mb})
        return {"lr": 0.0, "loss": 0.0}

    saved = train_step.forward_log_probs, train_step.train_step
    train_step.forward_log_probs, train_step.train_step = forward_log_probs, step
    try:
        yield
    finally:
        train_step.forward_log_probs, train_step.train_step = saved


def rank_advantages(estimator: str, dp_size: int, dp_rank: int) -> dict:
    """{"advantages": {i: A_i}, "returns": {i: returns_i} (ppo)} of this rank's samples."""
    from vime_core.trainer.rollout_training import train_on_rollout

    cfg = config(estimator)
    advantages, returns = {}, {}
    trainer = SimpleNamespace(
        cfg=cfg,
        layout=SimpleNamespace(dp_size=dp_size, dp_rank=dp_rank),
        arch=SimpleNamespace(vocab_size=32),
        device=torch.device("cpu"),
        model="policy",
        ref_model="reference",
        teacher_model=None,
        optimizer=None,
        scheduler=None,
        critic=_Critic(returns) if estimator == "ppo" else None,
    )
    with _stand_ins(advantages):
        train_on_rollout(trainer, batch(cfg))
    return {"advantages": advantages, "returns": returns}


def dump_rank_advantages(rank: int, world_size: int, port: int, out: str) -> None:
    """Worker of dist_workers.spawn: every estimator's advantages of this rank at DP=world_size."""
    torch.set_num_threads(1)
    from vime_core.trainer.parallel import destroy_parallel, init_parallel

    init_parallel(rank, world_size, "127.0.0.1", port, tp_size=1)
    try:
        result = {est: rank_advantages(est, world_size, rank) for est in ESTIMATORS}
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        destroy_parallel()
