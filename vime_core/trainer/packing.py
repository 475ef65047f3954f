"""Micro-batch packing: variable-length samples laid end to end in one sequence (THD format).

A micro-batch of samples with token lists ``x_0 .. x_{n-1}`` (lengths ``L_i``) becomes one row of
``T = sum_i L_i`` tokens with

    cu_seqlens = [0, L_0, L_0 + L_1, ..., T]            (int32, Megatron's PackedSeqParams)
    position_ids[cu_seqlens[i] + j] = j                (each sample restarts at position 0)

Megatron applies RoPE per sample from ``cu_seqlens`` and ``SDPACoreAttention`` attends causally
inside each sample only, so a packed forward equals n separate forwards.

Padding waste: **zero tokens** — THD packing needs no padding without sequence parallelism (we
never enable it), so the padding-waste bound is 0 per micro-batch, whatever the length mix.

Response positions: for sample i with prompt length P_i and response length R_i, the logits at
packed positions ``cu_seqlens[i] + P_i - 1 + t`` predict response token t (t < R_i), whose id is
``x_i[P_i + t]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class PackedMicroBatch:
    """One packed micro-batch (batch dimension 1)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [n + 1] int32, on the CPU whatever the device (see pack_samples)
    max_seqlen: int
    logit_index: torch.Tensor  # [N] packed positions whose logits predict response tokens
    targets: torch.Tensor  # [N] the response token ids they predict
    response_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def packed_seq_params(self) -> Any:
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )


def pack_samples(
    tokens: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    device: str | torch.device = "cpu",
) -> PackedMicroBatch:
    """Pack samples (prompt + response token lists) into one THD micro-batch."""
    if not tokens:
        raise ValueError("cannot pack an empty micro-batch")
    if len(tokens) != len(response_lengths):
        raise ValueError(f"{len(tokens)} token lists but {len(response_lengths)} response_lengths")
    lengths = [len(t) for t in tokens]
    for i, (length, resp) in enumerate(zip(lengths, response_lengths)):
        if not 0 < resp < length:
            raise ValueError(
                f"sample {i}: response_length={resp} must be >= 1 and < its {length} tokens "
                "(a response needs at least one prompt token before it)"
            )
    flat = torch.tensor([t for seq in tokens for t in seq], dtype=torch.long)
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    positions = torch.cat([torch.arange(length) for length in lengths])
    logit_index = torch.cat(
        [torch.arange(start + length - resp - 1, start + length - 1) for start, length, resp in zip(cu, lengths, response_lengths)]
    )
    return PackedMicroBatch(
        input_ids=flat.unsqueeze(0).to(device),
        position_ids=positions.unsqueeze(0).to(device),
        # Host-side on purpose: every reader (Megatron's THD RoPE, SDPACoreAttention) turns it into
        # Python ints, 3x per layer; on a GPU each of those reads was a device sync.
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(lengths),
        logit_index=logit_index.to(device),
        targets=flat[logit_index + 1].to(device),
        response_lengths=list(response_lengths),
    )
