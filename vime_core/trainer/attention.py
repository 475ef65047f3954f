"""Core attention for Megatron's local layer spec on SDPA, which picks a fused kernel instead of
materialising Megatron's [b, h, s, s] scores; with THD packing attention is causal inside each
sample, never over the whole [t, t] square (packing.py).

    context[b, h, i] = sum_j softmax_j(q[b, h, i] . k[b, g(h), j] / sqrt(d) + bias[i, j]) v[b, g(h), j]

g(h) = h // (heads / kv_groups) (grouped-query attention); bias = -inf where Megatron's mask is True."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Drop-in for ``DotProductAttention`` in ``get_gpt_layer_local_spec`` (same constructor).

    q is [s, b, heads, d], k/v [s, b, kv_groups, d] (per TP rank), the output [s, b, heads * d]; THD-packed
    q/k/v arrive as [t, heads, d]. On a GPU in half precision one variable-length FlashAttention call
    per layer (no K/V repeat; offsets int32 on the device, the longest segment a Python int: no sync);
    elsewhere SDPA per segment, or one batched call when all segments have the same length."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPACoreAttention does not support context parallelism")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp_size = pg_collection.tp.size()
        self.heads_per_rank = divide(config.num_attention_heads, tp_size)
        self.groups_per_rank = divide(config.num_query_groups or config.num_attention_heads, tp_size)
        self.head_dim = config.kv_channels
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention does not take attention_bias")
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed qkv_format={packed_seq_params.qkv_format!r}; only 'thd'")
            return self._packed(query, key, value, packed_seq_params)
        seq_len, batch = query.shape[0], query.shape[1]
        q = query.permute(1, 2, 0, 3)  # [b, heads, s, d]
        k = key.permute(1, 2, 0, 3)  # [b, groups, s, d]
        v = value.permute(1, 2, 0, 3)
        repeat = self.heads_per_rank // self.groups_per_rank
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        allowed = None if attention_mask is None else ~attention_mask
        context = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=self.dropout_p if self.training else 0.0,
            is_causal=attention_mask is None,
            scale=self.softmax_scale,
        )
        return context.permute(2, 0, 1, 3).reshape(seq_len, batch, self.heads_per_rank * self.head_dim)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """q [t, heads, d], k/v [t, groups, d] -> [t, 1, heads * d], causal inside each segment."""
        if _varlen_kernel_applies(query):
            return self._packed_varlen(query, key, value, params)
        return self._packed_per_segment(query, key, value, params)

    def _packed_varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """One FlashAttention varlen call over every segment (GPU, bf16/fp16)."""
        cu = getattr(params, "cu_seqlens_device", None)
        if cu is None or cu.device != query.device:  # offsets from elsewhere: copy them (one sync)
            cu = params.cu_seqlens_q.to(device=query.device, dtype=torch.int32)
        # Dense [t, heads, d] operands: value is a strided view into the fused QKV projection
        # (query and key come out of RoPE as new tensors, for which this is a no-op).
        q, k, v = query.contiguous(), key.contiguous(), value.contiguous()
        dropout_p = self.dropout_p if self.training else 0.0
        out = flash_varlen_causal(q, k, v, cu, int(params.max_seqlen_q), dropout_p, self.softmax_scale)
        return out.reshape(out.shape[0], 1, self.heads_per_rank * self.head_dim)

    def _packed_per_segment(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any
    ) -> torch.Tensor:
        """SDPA per segment, or one batched call when all segments have the same length."""
        cu_seqlens = params.cu_seqlens_q
        total = query.shape[0]
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if len(set(lengths)) == 1:  # equal lengths: one batched call, segments become the batch
            n, s = len(lengths), lengths[0]
            out = self.forward(
                query.view(n, s, *query.shape[1:]).transpose(0, 1),
                key.view(n, s, *key.shape[1:]).transpose(0, 1),
                value.view(n, s, *value.shape[1:]).transpose(0, 1),
                None,
            )  # [s, n, heads * d]
            return out.transpose(0, 1).reshape(total, 1, -1)
        outs = [
            self.forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1), None)
            for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
        ]
        return torch.cat(outs, dim=0)


def flash_varlen_causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float,
    scale: float,
) -> torch.Tensor:
    """FlashAttention-2 over packed segments: q [t, heads, d], k/v [t, groups, d] (heads a multiple
    of groups), ``cu_seqlens`` int32 on q's device, ``max_seqlen`` a Python int -> [t, heads, d],
    causal inside each segment. Differentiable (aten's derivative calls the varlen backward,
    which sums dK/dV over each group's query heads)."""
    return torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        True,  # is_causal (q and k segments have the same lengths: top-left = bottom-right)
        False,  # return_debug_mask
        scale=scale,
    )[0]


def _varlen_kernel_applies(query: torch.Tensor) -> bool:
    """FlashAttention's varlen kernel: CUDA, half precision, head dim a multiple of 8 up to 256."""
    head_dim = query.shape[-1]
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and head_dim % 8 == 0 and head_dim <= 256
