"""Non-finite optimizer steps (vime_core/trainer/nonfinite.py): the local check, the count of
skipped steps in a row and its one-line error, which the train flow does not retry. The real
Megatron step is tested in tests/integration/trainer/test_nonfinite_steps.py."""

from __future__ import annotations

import math

import pytest
import torch

from vime_core.faults import CONFIGURATION, classify
from vime_core.trainer.nonfinite import NonFiniteStepsError, SkipCounter, gradient_buffers, step_is_finite


def _linear_with_grad(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    model.weight.grad[1, 2] = value
    return model


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_one_non_finite_gradient_element_or_loss_fails_the_check(bad):
    assert step_is_finite(_linear_with_grad(1.0), torch.tensor(0.3, dtype=torch.float64), "cpu")
    assert not step_is_finite(_linear_with_grad(bad), torch.tensor(0.3, dtype=torch.float64), "cpu")
    assert not step_is_finite(_linear_with_grad(1.0), torch.tensor(bad, dtype=torch.float64), "cpu")
    # finite elements whose sum is large stay finite: the sum is in fp32, whose range is 3e38
    assert step_is_finite(_linear_with_grad(3e37), 0.0, "cpu")


def test_the_gradients_of_a_megatron_ddp_model_are_its_grad_buffers():
    """Megatron's DDP keeps `buffers` (a list shadowing nn.Module.buffers) with `grad_data`."""

    class Buffer:
        def __init__(self, value):
            self.grad_data = torch.full((4,), value)

    class DDP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.buffers = [Buffer(0.0)]
            self.expert_parallel_buffers = [Buffer(math.nan)]

    model = DDP()
    assert [b.tolist()[0] for b in gradient_buffers(model)][0] == 0.0 and len(gradient_buffers(model)) == 2
    assert not step_is_finite(model, 0.0, "cpu")
    model.expert_parallel_buffers = []
    assert step_is_finite(model, 0.0, "cpu")


def test_the_run_stops_after_more_than_max_skipped_steps_in_a_row():
    counter = SkipCounter(2)
    counter.begin(6)
    counter.record(skipped=True)
    counter.record(skipped=True)
    counter.record(skipped=False)  # a finite step resets the count in a row
    counter.begin(7)
    counter.record(skipped=True)
    counter.record(skipped=True)
    assert (counter.in_a_row, counter.skipped) == (2, 2)
    with pytest.raises(NonFiniteStepsError) as err:
        counter.record(skipped=True)
    message = str(err.value)
    assert "\n" not in message and len(message) <= 300  # the train flow's line shows 300 characters
    assert message.startswith(
        "rollout 7: 3 policy optimizer steps in a row had a non-finite loss or gradient "
        "(max_skipped_steps=2); none was applied"
    )


def test_max_skipped_steps_zero_stops_at_the_first():
    counter = SkipCounter(0, whose="critic")
    counter.begin(0)
    counter.record(skipped=False)
    with pytest.raises(NonFiniteStepsError, match=r"^rollout 0: 1 critic optimizer steps in a row"):
        counter.record(skipped=True)


def test_non_finite_steps_are_a_data_error_the_train_flow_does_not_retry():
    """Raised in a trainer actor, it reaches the driver as RayTaskError; neither the iteration
    nor the train task tries it again (a second try trains the same batch on the same weights)."""
    from types import SimpleNamespace

    from ray.exceptions import RayTaskError

    from tasks.common import retry_unless_configuration

    counter = SkipCounter(0)
    counter.begin(4)
    with pytest.raises(NonFiniteStepsError) as err:
        counter.record(skipped=True)
    remote = RayTaskError("train", "Traceback (most recent call last):\n  ...", err.value).as_instanceof_cause()
    for exc in (err.value, remote):
        fault = classify(exc)
        assert (fault.kind, fault.retryable, fault.error_type) == (CONFIGURATION, False, "NonFiniteStepsError")
        assert fault.what == str(err.value)
        assert not retry_unless_configuration(None, None, SimpleNamespace(data=exc))


def test_step_optimizer_moves_nothing_on_a_non_finite_step(monkeypatch):
    """step_optimizer around fakes of Megatron's pieces: a NaN gradient means no optimizer step,
    no schedule step, zeroed gradients, grad_norm None; a finite one steps both."""
    from vime_core.trainer import train_step
    from vime_core.trainer.train_step import step_optimizer

    calls: list[str] = []
    monkeypatch.setattr(train_step, "finalize_model_grads", lambda models: calls.append("finalize"))
    monkeypatch.setattr(train_step, "current_lr", lambda opt: 1e-3)

    class Optimizer:
        def step(self):
            calls.append("step")
            return True, 0.75, None

        def zero_grad(self):
            calls.append("zero_grad")

    class Scheduler:
        def step(self, increment):
            calls.append("schedule")

    cfg = SimpleCfg(clip_grad=1.0, max_skipped_steps=3)
    model = _linear_with_grad(math.nan)
    model.zero_grad_buffer = lambda: calls.append("zero_grad_buffer")
    counter = SkipCounter(3)
    assert step_optimizer(model, Optimizer(), Scheduler(), cfg, 0.0, "cpu", counter) == (None, 1e-3)
    assert calls == ["finalize", "zero_grad_buffer", "zero_grad"] and counter.in_a_row == 1
    calls.clear()
    model = _linear_with_grad(1.0)
    model.zero_grad_buffer = lambda: calls.append("zero_grad_buffer")
    assert step_optimizer(model, Optimizer(), Scheduler(), cfg, 0.0, "cpu", counter) == (0.75, 1e-3)
    assert calls == ["finalize", "step", "schedule"] and counter.in_a_row == 0


def test_a_step_megatron_itself_skips_is_counted_and_logged(monkeypatch, caplog):
    """Megatron's optimizer may refuse a step itself (an fp16 grad scaler's found_inf: step()
    returns not-ok): nothing moved, so it counts as skipped, with a warning, and the schedule
    does not advance."""
    import logging

    from vime_core.trainer import train_step
    from vime_core.trainer.train_step import step_optimizer

    calls: list[str] = []
    monkeypatch.setattr(train_step, "finalize_model_grads", lambda models: calls.append("finalize"))
    monkeypatch.setattr(train_step, "current_lr", lambda opt: 1e-3)

    class RefusingOptimizer:
        def step(self):
            calls.append("step")
            return False, None, None

        def zero_grad(self):
            calls.append("zero_grad")

    class Scheduler:
        def step(self, increment):
            calls.append("schedule")

    model = _linear_with_grad(1.0)
    model.zero_grad_buffer = lambda: calls.append("zero_grad_buffer")
    counter = SkipCounter(3)
    with caplog.at_level(logging.WARNING):
        assert step_optimizer(
            model, RefusingOptimizer(), Scheduler(), SimpleCfg(clip_grad=1.0, max_skipped_steps=3), 0.0, "cpu", counter
        ) == (None, 1e-3)
    assert "schedule" not in calls and counter.in_a_row == 1 and counter.skipped == 1
    assert "found a non-finite gradient and skipped the step" in caplog.text


class SimpleCfg:
    def __init__(self, **fields):
        self.__dict__.update(fields)
