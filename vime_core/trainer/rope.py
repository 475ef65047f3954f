"""RoPE on THD-packed micro-batches, fused: Megatron's rope-fusion hook filled without Transformer
Engine. Row r of sample i sits at position p(r) = r - cu_i; with Megatron's frequency table f:

    y = t * cos(f[p]) + rotate_half(t) * sin(f[p]),    rotate_half([a, b]) = [-b, a]

Megatron's unfused `_apply_rotary_pos_emb_thd`, with cos and sin built once per micro-batch and on
CUDA one compiled kernel each way. `install()` puts `packed_rope` into Megatron's hook."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils

from vime_core.trainer.compiled import run_compiled
from vime_core.trainer.packing import to_device

# (cu_seqlens, freqs, dtype, device) -> (cos, sin) of the last micro-batch: strong references, so
# the identities compared below cannot be reused by other tensors while cached.
_last: tuple[Any, ...] | None = None


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """[T] int64 positions restarting at 0 at each ``cu_seqlens`` offset (a CPU tensor)."""
    offsets = cu_seqlens.to("cpu", torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    total = int(offsets[-1])
    return torch.arange(total) - torch.repeat_interleave(offsets[:-1], lengths)


def cos_sin(cu_seqlens: torch.Tensor, freqs: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of ``freqs`` at each packed row's position, [T, 1, d] in ``dtype`` (Megatron
    casts them to the activations' dtype before multiplying, as here); cached per micro-batch."""
    global _last
    if _last is not None and _last[0] is cu_seqlens and _last[1] is freqs and _last[2] == dtype:
        return _last[3], _last[4]
    positions = to_device(packed_positions(cu_seqlens), freqs.device)
    angles = freqs.reshape(freqs.shape[0], freqs.shape[-1]).index_select(0, positions).unsqueeze(1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    _last = (cu_seqlens, freqs, dtype, cos, sin)
    return cos, sin


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` over the first ``cos.shape[-1]`` channels of ``t`` (the
    rest pass through, as Megatron's ``t_pass``)."""
    rot = cos.shape[-1]
    x, rest = t[..., :rot], t[..., rot:]
    x1, x2 = x.chunk(2, dim=-1)
    y = x * cos + torch.cat((-x2, x1), dim=-1) * sin
    return torch.cat((y, rest), dim=-1) if rest.shape[-1] else y


def packed_rope(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, cp_size: int = 1, cp_rank: int = 0
) -> torch.Tensor:
    """RoPE of a THD-packed ``t`` [T, h, d] (module docstring); Megatron's
    ``fused_apply_rotary_pos_emb_thd`` signature."""
    if cp_size != 1:
        raise ValueError(f"packed RoPE with context parallelism (cp_size={cp_size}) is not supported")
    if cu_seqlens.numel() and int(cu_seqlens[-1]) != t.shape[0]:
        raise ValueError(f"packed RoPE: cu_seqlens ends at {int(cu_seqlens[-1])}, the tensor has {t.shape[0]} rows")
    cos, sin = cos_sin(cu_seqlens, freqs, t.dtype)
    return run_compiled(rotate, t, cos, sin)


def _unfused_bshd(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False, **kwargs: Any) -> torch.Tensor:
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


def install() -> None:
    """Fill Megatron's RoPE-fusion hooks: ``packed_rope`` for THD, Megatron's unfused code for the
    [s, b, h, d] layout. Idempotent; hooks Transformer Engine already filled are kept."""
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = packed_rope
    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = _unfused_bshd
