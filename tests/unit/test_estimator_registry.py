"""A new advantage estimator is one registration (vime_core/algo/registry.py): the configuration
accepts its name, the batch builder uses its group normalisation, the trainer its advantages, the
train step its policy loss, the gates and the configuration's checks its rules."""

from __future__ import annotations

import statistics

import pytest
import torch

from vime_core.algo import registry
from vime_core.algo.registry import register_adv_est
from vime_core.config import load_config, parse_args
from vime_core.config.loader import ConfigError
from vime_core.data.batch import build_batch
from vime_core.data.sample import Sample, Status, WeightSpan

RAW = [2.0, 0.0, 1.0]
RESPONSE_LENGTHS = [3, 1, 2]
LOG_PROB = -0.5


@pytest.fixture
def own_registry(monkeypatch):
    """Registrations made by a test go into copies of the registries, dropped after it."""
    import vime_core.algo.losses  # noqa: F401  the built-in policy losses first (the estimators: vime_core.algo)

    monkeypatch.setattr(registry, "_ADV_ESTIMATORS", dict(registry._ADV_ESTIMATORS))
    monkeypatch.setattr(registry, "_POLICY_LOSSES", dict(registry._POLICY_LOSSES))


def _register_doubled_mean() -> None:
    """The one place: a mean-centred estimator whose token advantage is twice the sample's,
    trained with CISPO, with token rewards, whose loss needs the recomputed old log-probs."""

    @register_adv_est(
        "doubled_mean",
        group_normalisation="mean",
        policy_loss="cispo",
        token_rewards=True,
        reuse_log_probs=False,
        summary="a test's",
    )
    def doubled(rewards, loss_masks, *, kl=None, values=None, gamma=1.0, lambd=1.0, kl_coef=0.0):
        advantages = [torch.full((len(m),), 2 * float(r)) for r, m in zip(rewards.tolist(), loss_masks)]
        return advantages, advantages


def _samples() -> list[Sample]:
    samples = []
    for i, (reward, n) in enumerate(zip(RAW, RESPONSE_LENGTHS)):
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
        s.append_response_tokens(list(range(10, 10 + n)), [LOG_PROB] * n)
        s.weight_versions = [WeightSpan(1, 0, n)]
        samples.append(s)
    return samples


def test_a_registered_estimator_is_selectable_and_unknown_ones_are_refused_naming_the_choices(own_registry):
    with pytest.raises(ConfigError, match=r"advantage_estimator: unknown advantage estimator 'doubled_mean'"):
        load_config(overrides={"advantage_estimator": "doubled_mean"})
    _register_doubled_mean()
    assert load_config(overrides={"advantage_estimator": "doubled_mean"}).advantage_estimator == "doubled_mean"
    assert parse_args(["--advantage-estimator", "doubled_mean"]).advantage_estimator == "doubled_mean"
    with pytest.raises(
        ConfigError,
        match=r"advantage_estimator: unknown advantage estimator 'nope'; registered: \[.*'doubled_mean'.*'grpo'",
    ):
        load_config(overrides={"advantage_estimator": "nope"})
    # its token rewards take kl_coef, which grpo (none) refuses
    assert load_config(overrides={"advantage_estimator": "doubled_mean", "kl_coef": 0.05}).kl_coef == 0.05
    with pytest.raises(ConfigError, match="kl_coef=0.05 is the KL penalty in the token rewards"):
        load_config(overrides={"kl_coef": 0.05})


def test_the_registration_decides_normalisation_advantages_gates_and_loss(own_registry, monkeypatch):
    from vime_core.algo.gates import can_reuse_log_probs_in_loss
    from vime_core.algo.losses import PolicyLossParams, aggregate_loss, compute_cispo_loss, compute_policy_loss
    from vime_core.trainer import train_step
    from vime_core.trainer.rollout_training import step_advantages

    _register_doubled_mean()
    cfg = load_config(overrides={"advantage_estimator": "doubled_mean"})
    assert can_reuse_log_probs_in_loss([8], cfg) is False
    assert can_reuse_log_probs_in_loss([8], load_config()) is True  # grpo, everything else equal

    batch = build_batch(_samples(), cfg)
    mean = statistics.fmean(RAW)
    assert batch["reward"] == pytest.approx([r - mean for r in RAW])  # centred, not divided by the std

    indices = list(range(len(RAW)))
    advantages, _ = step_advantages(cfg, batch, indices, None, None)
    expected = torch.cat([torch.full((n,), 2 * (r - mean)) for r, n in zip(RAW, RESPONSE_LENGTHS)])
    assert torch.cat([advantages[i] for i in indices]).tolist() == pytest.approx(expected.tolist())

    log_probs = torch.full((sum(RESPONSE_LENGTHS),), LOG_PROB, requires_grad=True)
    monkeypatch.setattr(
        train_step, "packed_response_log_probs", lambda *a, **k: (log_probs, torch.zeros_like(log_probs))
    )
    mb = train_step.make_micro_batch(batch, indices, "cpu")
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=[indices],
        advantages=advantages,
        old_log_probs=None,
        denominators=train_step.StepDenominators.of(batch, indices),
    )
    acc = train_step._Accumulator()
    train_step.micro_batch_loss(None, mb, inputs, cfg, 19, acc)

    params = PolicyLossParams.from_config(cfg)
    mask = torch.ones_like(log_probs)
    cispo, _ = compute_cispo_loss(torch.zeros_like(log_probs), log_probs.detach(), expected, params.eps_clip_high)
    ppo, _ = compute_policy_loss(torch.zeros_like(log_probs), expected, params.eps_clip, params.eps_clip_high)
    assert acc.pg_loss == pytest.approx(float(aggregate_loss(cispo, mask, cfg.loss_agg_mode)))
    assert acc.pg_loss != pytest.approx(float(aggregate_loss(ppo, mask, cfg.loss_agg_mode)))


@pytest.mark.integration  # a fresh interpreter
def test_the_configuration_reads_the_registered_names_without_torch():
    """`vime train --help` stays instant: the registry, the built-in estimators' module and the
    configuration import no torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from vime_core.config.loader import build_parser\n"
        "from vime_core.algo.registry import registered_adv_estimators\n"
        "help_text = build_parser().format_help()\n"
        "assert all(name in help_text for name in registered_adv_estimators()), help_text\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
