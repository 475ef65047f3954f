"""megatron-core's MoE layer without Transformer Engine (absent on the CPU box and the GPU host).

megatron-core 0.16.1's ``moe_utils`` imports ``te_general_gemm`` from Transformer Engine inside a
try block, and the router's gating GEMM (``RouterGatingLinearFunction``) tests
``te_general_gemm is not None`` unguarded: without TE the name is undefined and every MoE forward
raises NameError. Defining it as None selects the ``torch.mm`` path megatron-core already has (its
other TE kernels are guarded by ``HAVE_TE``)."""

from __future__ import annotations

from megatron.core.transformer.moe import moe_utils


def define_missing_te_gemm() -> bool:
    """Set ``moe_utils.te_general_gemm`` to None when TE left it undefined (idempotent); whether it did."""
    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    return True
