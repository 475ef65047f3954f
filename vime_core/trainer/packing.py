"""Micro-batch packing: variable-length samples laid end to end in one sequence (THD format), so a
micro-batch needs no padding and a packed forward equals n separate forwards:

    cu_seqlens = [0, L_0, L_0 + L_1, ..., T]            (int32, Megatron's PackedSeqParams)
    position_ids[cu_seqlens[i] + j] = j                (each sample restarts at position 0)

The logits at packed position cu_seqlens[i] + P_i - 1 + t predict response token t of sample i."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedMicroBatch:
    """One packed micro-batch (batch dimension 1)."""

    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [n + 1] int32, on the CPU whatever the device (see pack_samples)
    cu_seqlens_device: torch.Tensor  # the same offsets on the model's device, for varlen attention kernels
    max_seqlen: int
    logit_index: torch.Tensor  # [N] packed positions whose logits predict response tokens
    targets: torch.Tensor  # [N] the response token ids they predict
    response_lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def packed_seq_params(self) -> Any:
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )
        # Megatron's fields keep the host copy (its RoPE reads them as Python ints); the varlen
        # kernel in SDPACoreAttention needs them on the device, without a copy per layer.
        params.cu_seqlens_device = self.cu_seqlens_device
        return params


def to_device(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """``tensor`` (on the CPU) on ``device``; to a GPU through pinned memory without blocking the
    host (the caching host allocator keeps the pinned block until the copy has run).

    A plain copy from pageable memory waits for everything queued on the GPU, so each micro-batch's
    inputs would stall the host until the previous backward had run."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


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
        [
            torch.arange(start + length - resp - 1, start + length - 1)
            for start, length, resp in zip(cu, lengths, response_lengths)
        ]
    )
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    return PackedMicroBatch(
        input_ids=to_device(flat.unsqueeze(0), device),
        position_ids=to_device(positions.unsqueeze(0), device),
        # Host-side on purpose: Megatron's THD RoPE turns it into Python ints twice per layer; on a
        # GPU each of those reads was a device sync. The device copy is for the varlen kernel.
        cu_seqlens=cu_seqlens,
        cu_seqlens_device=to_device(cu_seqlens, device),
        max_seqlen=max(lengths),
        logit_index=to_device(logit_index, device),
        targets=to_device(flat[logit_index + 1], device),
        response_lengths=list(response_lengths),
    )
