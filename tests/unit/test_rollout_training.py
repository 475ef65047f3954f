"""train_on_rollout's choice of log-probs (vime_core/trainer/rollout_training.py), with the forwards
and the optimizer step replaced: which forwards run, and the KL that reaches the token rewards."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from vime_core.config import load_config
from vime_core.data.batch import build_batch
from vime_core.data.sample import Sample, Status, WeightSpan

RAW = [1.0, 0.0, 1.0]
ROLLOUT_LOG_PROBS = [[-0.2, -0.9, -0.4], [-1.3], [-0.6, -0.1]]
REF_LOG_PROB = -0.7
OLD_LOG_PROB = -0.3  # what a recompute of the old policy would give: not the engine's


def _batch(cfg) -> dict:
    samples = []
    for i, (reward, log_probs) in enumerate(zip(RAW, ROLLOUT_LOG_PROBS)):
        s = Sample(
            prompt_id="p0",
            tokens=[1, 2],
            prompt_length=2,
            group_index=0,
            index=i,
            session_id=f"s-{i}",
            status=Status.COMPLETED,
            finish_reason="stop",
            reward=reward,
        )
        s.append_response_tokens(list(range(10, 10 + len(log_probs))), log_probs)
        s.weight_versions = [WeightSpan(1, 0, len(log_probs))]
        samples.append(s)
    return build_batch(samples, cfg)


class _Trainer:
    """What train_on_rollout reads of a MegatronTrainer, on one rank."""

    def __init__(self, cfg, with_ref: bool):
        self.cfg = cfg
        self.layout = SimpleNamespace(dp_size=1, dp_rank=0)
        self.arch = SimpleNamespace(vocab_size=32)
        self.device = "cpu"
        self.model = "policy"
        self.ref_model = "reference" if with_ref else None
        self.teacher_model = None
        self.optimizer = self.scheduler = None


@pytest.fixture
def trained(monkeypatch):
    """train_on_rollout(cfg) -> (forwards run, per step: the StepInputs given to train_step)."""
    from vime_core.trainer import rollout_training
    from vime_core.trainer.rollout_training import train_on_rollout

    def run(cfg):
        forwards, steps = [], []

        def forward_log_probs(model, batch, micro_batches, vocab, temperature, device, replay=False):
            forwards.append(model)
            value = REF_LOG_PROB if model == "reference" else OLD_LOG_PROB
            return {i: torch.full((int(batch["response_length"][i]),), value) for mb in micro_batches for i in mb}

        def step(model, optimizer, inputs, *args, **kwargs):
            steps.append(inputs)
            return {"lr": 0.0, "loss": 0.0}

        monkeypatch.setattr(rollout_training, "forward_log_probs", forward_log_probs)
        monkeypatch.setattr(rollout_training, "train_step", step)
        train_on_rollout(_Trainer(cfg, with_ref=cfg.kl_coef > 0 or cfg.use_kl_loss), _batch(cfg))
        return forwards, steps

    return run


def _config(**fields):
    return load_config(
        overrides={
            "rollout_batch_size": 1,
            "n_samples_per_prompt": len(RAW),
            "micro_batch_size": len(RAW),
            "advantage_estimator": "reinforce_plus_plus",
            "kl_loss_type": "k3",
            **fields,
        }
    )


def _reinforce_plus_plus(kl: list[list[float]], kl_coef: float) -> list[float]:
    """The reference REINFORCE++ advantages, by hand: r_t = -kl_coef kl_t (+ the reward at the last
    token), G_t = sum_{k >= t} r_k (gamma = 1), whitened over all tokens with the unbiased std."""
    returns = []
    for reward, kl_i in zip(RAW, kl):
        token_rewards = [-kl_coef * k for k in kl_i]
        token_rewards[-1] += reward
        returns.extend(sum(token_rewards[t:]) for t in range(len(token_rewards)))
    mean, var = statistics.fmean(returns), statistics.variance(returns)
    return [(g - mean) / math.sqrt(var + 1e-8) for g in returns]


def _k3(log_p: float, log_ref: float) -> float:
    return math.exp(log_ref - log_p) - 1 + (log_p - log_ref)


def test_kl_penalty_with_rollout_log_probs_uses_the_engine_log_probs_as_the_old_policy(trained):
    """REINFORCE++ with kl_coef > 0 and use_rollout_logprobs: the token rewards' KL is
    KL(engine log-probs || reference), as slime computes it; no recompute of the old policy runs."""
    cfg = _config(kl_coef=0.5, use_rollout_logprobs=True)
    forwards, steps = trained(cfg)
    assert forwards == ["reference"]
    kl = [[_k3(lp, REF_LOG_PROB) for lp in sample] for sample in ROLLOUT_LOG_PROBS]
    advantages = torch.cat([steps[0].advantages[i] for i in range(len(RAW))]).tolist()
    assert advantages == pytest.approx(_reinforce_plus_plus(kl, 0.5), abs=1e-5)
    assert advantages != pytest.approx(_reinforce_plus_plus([[0.0] * len(s) for s in ROLLOUT_LOG_PROBS], 0.5), abs=1e-3)


def test_kl_penalty_with_mismatch_metrics_still_uses_the_engine_log_probs(trained):
    """get_mismatch_metrics recomputes the old log-probs for its metric; the old policy of the
    loss and of the KL penalty stays the engine's."""
    cfg = _config(kl_coef=0.5, use_rollout_logprobs=True, get_mismatch_metrics=True)
    forwards, steps = trained(cfg)
    assert sorted(forwards) == ["policy", "reference"]
    kl = [[_k3(lp, REF_LOG_PROB) for lp in sample] for sample in ROLLOUT_LOG_PROBS]
    advantages = torch.cat([steps[0].advantages[i] for i in range(len(RAW))]).tolist()
    assert advantages == pytest.approx(_reinforce_plus_plus(kl, 0.5), abs=1e-5)


def test_kl_penalty_with_recomputed_old_log_probs(trained):
    cfg = _config(kl_coef=0.5)
    forwards, steps = trained(cfg)
    assert sorted(forwards) == ["policy", "reference"]
    kl = [[_k3(OLD_LOG_PROB, REF_LOG_PROB)] * len(s) for s in ROLLOUT_LOG_PROBS]
    advantages = torch.cat([steps[0].advantages[i] for i in range(len(RAW))]).tolist()
    assert advantages == pytest.approx(_reinforce_plus_plus(kl, 0.5), abs=1e-5)


def test_kl_penalty_needs_the_engine_log_probs_of_every_sample(trained, monkeypatch):
    cfg = _config(kl_coef=0.5, use_rollout_logprobs=True)
    from vime_core.trainer import rollout_training

    real = rollout_training.step_advantages

    def without_log_probs(cfg, batch, *args):
        batch = dict(batch, rollout_log_probs=[[], *batch["rollout_log_probs"][1:]])
        return real(cfg, batch, *args)

    monkeypatch.setattr(rollout_training, "step_advantages", without_log_probs)
    with pytest.raises(ValueError, match="use_rollout_logprobs .* sample 0 has no rollout_log_probs"):
        trained(cfg)


@pytest.mark.parametrize("flag", ["use_rollout_logprobs", "use_tis", "get_mismatch_metrics"])
def test_a_batch_without_engine_log_probs_is_refused_before_any_forward_where_a_flag_reads_them(monkeypatch, flag):
    """A replayed batch generated without log-probs (no flag read them then): the trainer stops
    in one line naming the column and the flag, before a forward or a step."""
    from vime_core.data.validation import UntrainableBatchError
    from vime_core.trainer import rollout_training
    from vime_core.trainer.rollout_training import train_on_rollout

    cfg = _config(**{flag: True})
    batch = _batch(cfg)
    batch["rollout_log_probs"] = [[] for _ in batch["rollout_log_probs"]]
    monkeypatch.setattr(rollout_training, "forward_log_probs", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(
        UntrainableBatchError,
        match=rf"^sample 0 \(group 0 index 0, prompt 'p0'\): rollout_log_probs is empty .*and {flag} needs them$",
    ):
        train_on_rollout(_Trainer(cfg, with_ref=False), batch)


# ---- ppo: the critic's values, GAE, and which of the two models step --------------------------

VALUES = [[0.5, 0.2, -0.1], [0.3], [0.0, 0.4]]  # V_old per response token of each sample


class _Critic:
    """A critic with given values, recording what each of its steps was given."""

    def __init__(self):
        self.steps = []

    def values(self, batch, micro_batches):
        return {i: torch.tensor(VALUES[i]) for mb in micro_batches for i in mb}

    def train_step(self, batch, micro_batches, denominators, returns, old_values, dp_size, dp_group):
        self.steps.append({"returns": returns, "old_values": old_values, "micro_batches": micro_batches})
        return {"value_loss": 0.25, "critic_lr": 0.1}


@pytest.mark.parametrize("rollout_id, policy_trains", [(0, False), (1, True)])
def test_ppo_advantages_are_gae_on_the_critics_values_and_both_models_step(monkeypatch, rollout_id, policy_trains):
    """gamma = 1, lambd = 0.5, reward at the last token (RAW: no group baseline for ppo), by hand:
    sample 0: deltas (t = 2, 1, 0) 1 + 0.1 = 1.1, -0.1 - 0.2 = -0.3, 0.2 - 0.5 = -0.3
              A = [-0.3 + 0.5 * 0.25, -0.3 + 0.5 * 1.1, 1.1] = [-0.175, 0.25, 1.1]
    sample 1: A = [0 - 0.3]; sample 2: A = [0.4 + 0.5 * 0.6, 1 - 0.4] = [0.7, 0.6]
    returns = A + V; the policy's advantages are A whitened over the step's six tokens. The
    critic steps every rollout; the policy from num_critic_only_steps = 1 on."""
    from vime_core.trainer import rollout_training
    from vime_core.trainer.rollout_training import train_on_rollout

    cfg = _config(advantage_estimator="ppo", lambd=0.5, num_critic_only_steps=1)
    trainer = _Trainer(cfg, with_ref=False)
    trainer.critic = _Critic()
    policy_steps, forwards = [], []
    monkeypatch.setattr(
        rollout_training,
        "forward_log_probs",
        lambda model, batch, mbs, *a: (
            forwards.append(model)
            or {i: torch.full((int(batch["response_length"][i]),), OLD_LOG_PROB) for mb in mbs for i in mb}
        ),
    )
    monkeypatch.setattr(
        rollout_training,
        "train_step",
        lambda model, optimizer, inputs, *a, **k: policy_steps.append(inputs) or {"lr": 0.0, "loss": 0.0},
    )
    metrics = train_on_rollout(trainer, _batch(cfg), rollout_id)

    gae = [[-0.175, 0.25, 1.1], [-0.3], [0.7, 0.6]]
    (step,) = trainer.critic.steps
    for i, (a, v) in enumerate(zip(gae, VALUES)):
        assert step["returns"][i].tolist() == pytest.approx([x + y for x, y in zip(a, v)])
        assert step["old_values"][i].tolist() == pytest.approx(v)
    assert metrics["value_loss"] == 0.25 and metrics["critic_lr"] == 0.1
    assert metrics["num_steps"] == (1 if policy_trains else 0) == len(policy_steps)
    assert forwards == (["policy"] if policy_trains else [])  # critic-only: no KL penalty, no policy forward
    if policy_trains:
        flat = [x for a in gae for x in a]
        mean, std = statistics.fmean(flat), statistics.stdev(flat)
        advantages = torch.cat([policy_steps[0].advantages[i] for i in range(len(RAW))]).tolist()
        assert advantages == pytest.approx([(x - mean) / math.sqrt(std**2 + 1e-8) for x in flat], abs=1e-6)
