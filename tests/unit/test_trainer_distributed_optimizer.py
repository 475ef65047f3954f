"""The distributed optimizer's pieces that run in one process: the CPU shim that lets Megatron's
DistributedOptimizer take CPU parameters, and the per-parameter Adam step counters a checkpoint
load must leave separate (the multi-rank behaviour: tests/integration/trainer/test_moe_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from vime_core.trainer import compat_cpu
from vime_core.trainer.optimizer import own_step_counters


def test_cuda_type_name_of_cpu_tensors():
    assert compat_cpu.cuda_type_name(torch.zeros(1)) == "torch.cuda.FloatTensor"
    assert compat_cpu.cuda_type_name(torch.zeros(1, dtype=torch.bfloat16)) == "torch.cuda.BFloat16Tensor"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU layer is inert on CUDA machines")
def test_distributed_optimizer_sees_cuda_type_names_only_while_it_builds_its_shards():
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    compat_cpu.activate()
    param = torch.nn.Parameter(torch.zeros(3))
    seen = []

    class Probe(dict):
        """Megatron's first look-up of each parameter: records the type it reads, then stops the build."""

        def __getitem__(self, p):
            seen.append(p.type())
            raise LookupError("probe")

    with pytest.raises(LookupError):
        DistributedOptimizer._build_model_and_main_param_groups([], Probe(), [{"params": [param]}], None)
    assert seen == ["torch.cuda.FloatTensor"]
    assert param.type() == "torch.FloatTensor" and "type" not in vars(param)  # the attribute is gone


def _adam(params, steps: int, shared_after: int | None = None, separate: bool = False) -> torch.optim.Adam:
    """`steps` Adam steps on a fixed gradient; after step `shared_after`, one `step` tensor in every
    state (as DistributedOptimizer.load_state_dict leaves them), made separate again with `separate`."""
    opt = torch.optim.Adam(params, lr=0.1)
    for k in range(steps):
        for p in params:
            p.grad = torch.full_like(p, 0.5 + k)
        opt.step()
        if k + 1 == shared_after:
            shared = torch.tensor(float(shared_after))
            for state in opt.state.values():
                state["step"] = shared
            if separate:
                own_step_counters(opt)
    return opt


def test_own_step_counters_count_each_step_once():
    def params():
        return [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))]

    reference, shared, fixed = params(), params(), params()
    _adam(reference, 3)
    broken = _adam(shared, 3, shared_after=1)
    ok = _adam(fixed, 3, shared_after=1, separate=True)
    # one tensor for both parameters: each step adds 1 per parameter
    assert {float(s["step"]) for s in broken.state.values()} == {1 + 2 * len(shared)}
    assert not all(torch.equal(a, b) for a, b in zip(shared, reference))
    assert [float(s["step"]) for s in ok.state.values()] == [3.0, 3.0]
    for a, b in zip(fixed, reference):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
