"""Core attention for Megatron's local layer spec on ``torch.nn.functional.scaled_dot_product_attention``.

Megatron's local ``DotProductAttention`` materialises the [b, h, s, s] score matrix; SDPA picks a
fused kernel (flash / memory-efficient on GPUs, the flash CPU kernel on CPUs) and gives the same
result:

    context[b, h, i] = sum_j softmax_j(scale * q[b, h, i] . k[b, g(h), j] + bias[i, j]) v[b, g(h), j]

with ``scale = 1 / sqrt(head_dim)``, ``g(h) = h // (heads / kv_groups)`` (grouped-query attention:
each KV group serves ``heads / kv_groups`` consecutive query heads) and ``bias = -inf`` where
Megatron's mask is True (Megatron masks are "True = masked out"; SDPA boolean masks are
"True = attend", hence the inversion). A ``None`` mask means plain causal attention.

Layouts follow Megatron: q is [s, b, heads, d], k/v are [s, b, kv_groups, d] (per TP rank), the
output is [s, b, heads * d]. With THD packing (``packed_seq_params.qkv_format == "thd"``, see
``packing.py``) q/k/v arrive as [t, heads, d] for samples laid end to end; attention is causal
inside each sample (segments from ``cu_seqlens``), computed per segment, or in one batched call
when all segments have the same length — never over the whole [t, t] square.
"""

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
    """Drop-in for ``DotProductAttention`` in ``get_gpt_layer_local_spec`` (same constructor)."""

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
            return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)
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

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """q [t, heads, d], k/v [t, groups, d] -> [t, 1, heads * d], causal inside each segment."""
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
