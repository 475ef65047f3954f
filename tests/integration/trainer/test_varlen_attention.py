"""SDPACoreAttention's packed (THD) paths on the CPU: the choice of path by device and dtype, and
the varlen path's glue (offsets, layouts, output shape) around a stand-in for FlashAttention's
kernel that checks the kernel's contract. The real kernel runs in test_gpu_kernels.py (CUDA)."""

from __future__ import annotations

import pytest
import torch

LENGTHS = [7, 2, 12, 3]
HEADS, GROUPS, HEAD_DIM = 6, 2, 8


def _attention():
    from megatron.core.transformer.enums import AttnMaskType

    from vime_core.trainer.attention import SDPACoreAttention
    from vime_core.trainer.model import HFArchitecture, transformer_config

    arch = HFArchitecture(
        model_type="qwen2",
        vocab_size=100,
        hidden_size=HEADS * HEAD_DIM,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=GROUPS,
        head_dim=HEAD_DIM,
        ffn_hidden_size=32,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling_factor=None,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        qkv_bias=True,
        qk_norm=False,
    )
    return SDPACoreAttention(transformer_config(arch, 1, torch.float32), 1, AttnMaskType.causal, "self")


def _contract_kernel(calls):
    """Per-segment causal attention with FlashAttention's varlen contract asserted."""
    import torch.nn.functional as F

    def kernel(q, k, v, cu, max_seqlen, dropout_p, scale):
        assert cu.dtype == torch.int32 and cu.device == q.device and cu.is_contiguous()
        assert isinstance(max_seqlen, int) and dropout_p == 0.0
        assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
        assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and q.shape[0] == k.shape[0] == int(cu[-1])
        assert max_seqlen == int((cu[1:] - cu[:-1]).max())
        calls.append(len(cu) - 1)
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            qs, ks, vs = (x[a:b].transpose(0, 1) for x in (q, k, v))  # [heads or groups, s, d]
            rep = q.shape[1] // k.shape[1]
            ks, vs = ks.repeat_interleave(rep, 0), vs.repeat_interleave(rep, 0)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1))
        return torch.cat(outs)

    return kernel


def _qkv():
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen, requires_grad=True)
    kv = torch.randn(total, GROUPS, 2 * HEAD_DIM, generator=gen, requires_grad=True)
    return q, kv


def test_path_is_chosen_by_device_and_dtype():
    from vime_core.trainer.attention import _varlen_kernel_applies

    assert not _varlen_kernel_applies(torch.zeros(2, 2, 64))  # CPU
    assert not _varlen_kernel_applies(torch.zeros(2, 2, 64, device="meta", dtype=torch.bfloat16))
    assert not _varlen_kernel_applies(torch.zeros(2, 2, 64, device="meta"))


def test_varlen_glue_matches_per_segment_sdpa(single_rank, monkeypatch):
    """One kernel call for all segments (strided K/V views made dense, host offsets to int32 on
    the device, the output reshaped to [t, 1, heads * d]) == per-segment SDPA, with gradients."""
    import vime_core.trainer.attention as attention
    from vime_core.trainer.packing import pack_samples

    attn = _attention()
    params = pack_samples([[1] * n for n in LENGTHS], [1] * len(LENGTHS)).packed_seq_params()
    q, kv = _qkv()
    k, v = kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]  # strided views, as Megatron's QKV split gives
    grad_out = torch.randn(sum(LENGTHS), 1, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    ref = attn._packed_per_segment(q, k, v, params)
    ref_grads = torch.autograd.grad(ref, (q, kv), grad_out)

    calls: list[int] = []
    monkeypatch.setattr(attention, "_varlen_kernel_applies", lambda query: True)
    monkeypatch.setattr(attention, "flash_varlen_causal", _contract_kernel(calls))
    for device_offsets in (True, False):  # packed on the device, or offsets only on the host
        if not device_offsets:
            params.cu_seqlens_device = None
        out = attn(q, k, v, None, packed_seq_params=params)
        assert out.shape == (sum(LENGTHS), 1, HEADS * HEAD_DIM)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
        for ours, theirs in zip(torch.autograd.grad(out, (q, kv), grad_out), ref_grads):
            torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert calls == [len(LENGTHS)] * 2  # one call per layer, all segments at once


@pytest.mark.parametrize("lengths", [[5, 5, 5], [4, 9]])
def test_per_segment_path_is_causal_inside_segments_only(single_rank, lengths):
    """The CPU path: a segment's output does not change when the other segments change."""
    from vime_core.trainer.packing import pack_samples

    attn = _attention()
    params = pack_samples([[1] * n for n in lengths], [1] * len(lengths)).packed_seq_params()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(sum(lengths), h, HEAD_DIM, generator=gen) for h in (HEADS, GROUPS, GROUPS))
    out = attn(q, k, v, None, packed_seq_params=params)
    first = lengths[0]
    k2, v2 = k.clone(), v.clone()
    k2[first:] += 1.0
    v2[first:] -= 1.0
    out2 = attn(q, k2, v2, None, packed_seq_params=params)
    torch.testing.assert_close(out2[:first], out[:first], atol=0, rtol=0)
    assert not torch.allclose(out2[first:], out[first:])
