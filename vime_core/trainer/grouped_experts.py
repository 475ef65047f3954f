"""Grouped experts: a MoE layer's local experts as two grouped GEMMs instead of one small MLP each.

Megatron's grouped experts need Transformer Engine or the ``grouped_gemm`` package (absent on the CPU
box and the GPU host); torch's own ``torch._grouped_mm`` computes, for experts e with token rows
[o_{e-1}, o_e) of x (offsets o = cumsum(tokens per expert)),

    fc1:  u = x[o_{e-1}:o_e] @ W1_e^T                      (W1_e = [gate; up], [2f, h])
    act:  a = silu(u_gate) * u_up * p                       (p: each row's routing probability)
    fc2:  y = a @ W2_e^T                                    (W2_e [h, f])

in one kernel launch per GEMM for all experts (SequentialMLP launches ~10 kernels per expert and
layer, which leaves a GPU idle at few tokens per expert). The parameters stay SequentialMLP's, one
``MLP`` per expert (``local_experts.<i>.linear_fc1.weight``): checkpoints, HF conversion, publishing,
expert parallelism and DDP see the same tensors. Each GEMM stacks its experts' weights into one
[E, out, in] tensor (torch.stack: differentiable, so each expert's weight gets its own gradient),
which autograd keeps until the backward: one more copy of the local experts' weights per MoE layer
in flight, the price of the single launch. The math is the unfused MLP's (Megatron's fused SwiGLU
computes the same values in another order; the tests compare within float tolerance)."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import SequentialMLP


def grouped_mm_available(device: torch.device | str) -> bool:
    """Whether torch's grouped GEMM runs on ``device``: the CPU (torch >= 2.9), CUDA from Hopper (sm90) on."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9
    return device.type == "cpu"


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], offsets: torch.Tensor) -> torch.Tensor:
    """Rows [offsets[e-1], offsets[e]) of ``x`` [T, in] times ``weights[e]``^T ([out, in]): [T, out]."""
    stacked = torch.stack(weights)  # [E, out, in]
    return torch._grouped_mm(x, stacked.transpose(-2, -1), offs=offsets)


class GroupedMLP(SequentialMLP):
    """SequentialMLP's experts run as grouped GEMMs (module docstring) where ``grouped`` holds: bias-free
    SwiGLU experts in plain Megatron linears (not wrapped by LoRA), no fp8/fp4, probabilities applied
    after the activation; otherwise SequentialMLP's own loop runs, unchanged."""

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection: Any = None) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection)
        c = self.config
        self.grouped_config = (
            c.gated_linear_unit
            and c.activation_func is F.silu
            and not c.add_bias_linear
            and not (c.fp8 or c.fp4)
            and not c.moe_apply_probs_on_input
            and not getattr(c, "use_te_activation_func", False)
            and getattr(c, "activation_func_clamp_value", None) is None
            and not getattr(c, "glu_linear_offset", 0.0)
        )
        self.use_grouped = True  # False: SequentialMLP's loop (bench/bench_trainer_gpu.py's +seqexperts)

    def grouped(self) -> bool:
        """Whether this forward takes the grouped path (linears checked each time: LoRA wraps them
        later). The kernel needs every row of its operands 16-byte aligned: the hidden size and the
        expert's TP slice, in the weights' dtype."""
        if not (self.use_grouped and self.grouped_config) or not all(
            type(e.linear_fc1) is ColumnParallelLinear and type(e.linear_fc2) is RowParallelLinear
            for e in self.local_experts
        ):
            return False
        fc2 = self.local_experts[0].linear_fc2.weight  # [h, f / tp]
        return all(dim * fc2.element_size() % 16 == 0 for dim in fc2.shape)

    def forward(
        self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.grouped() or permuted_local_hidden_states.shape[0] == 0:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        counts = torch.as_tensor(tokens_per_expert)
        offsets = torch.cumsum(counts.to(device=x.device, dtype=torch.int32), dim=0, dtype=torch.int32)
        up = grouped_linear(x, [e.linear_fc1.weight for e in self.local_experts], offsets)
        gate, linear = torch.chunk(up, 2, dim=-1)
        hidden = (F.silu(gate) * linear * permuted_probs.unsqueeze(-1)).to(x.dtype)
        return grouped_linear(hidden, [e.linear_fc2.weight for e in self.local_experts], offsets), None
