"""vime's packed RoPE (rope.py) against Megatron's unfused THD RoPE: values, gradients, the
per-micro-batch cache, and the hooks it fills."""

from __future__ import annotations

import types

import pytest
import torch

from vime_core.trainer import rope

ONE_RANK = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # a context-parallel group of one


def _freqs(max_len: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's table layout: [S, 1, 1, d], angles p * theta_j twice (not interleaved)."""
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    return torch.cat((angles, angles), dim=-1)[:, None, None, :]


def _megatron(t, cu, freqs):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    return _apply_rotary_pos_emb_thd(t, cu, freqs, cp_group=ONE_RANK)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(rope, "_last", None)


def test_positions_restart_at_every_sample():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert rope.packed_positions(cu).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("lengths,rot_dim", [((5, 1, 9, 3), 16), ((7,), 16), ((4, 6), 8)])
def test_values_and_gradients_equal_megatrons_unfused(lengths, rot_dim):
    """rot_dim 8 of head_dim 16: the channels past the rotary dimension pass through."""
    gen = torch.Generator().manual_seed(sum(lengths))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = _freqs(max(lengths), rot_dim)
    t = torch.randn(int(cu[-1]), 3, 16, generator=gen, dtype=torch.float64).requires_grad_()
    ref_t = t.detach().clone().requires_grad_()
    ours, ref = rope.packed_rope(t, cu, freqs.double()), _megatron(ref_t, cu, freqs.double())
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-12)
    assert not torch.allclose(ours, t)  # rotated, not passed through
    g = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours.backward(g)
    ref.backward(g)
    torch.testing.assert_close(t.grad, ref_t.grad, rtol=0, atol=1e-12)


def test_cos_and_sin_are_built_once_per_micro_batch():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    freqs = _freqs(8, 8)
    q, k = torch.randn(10, 4, 8), torch.randn(10, 2, 8)
    first = rope.cos_sin(cu, freqs, q.dtype)
    rope.packed_rope(q, cu, freqs)
    rope.packed_rope(k, cu, freqs)
    again = rope.cos_sin(cu, freqs, q.dtype)
    assert again[0] is first[0] and again[1] is first[1]
    other = rope.cos_sin(cu.clone(), freqs, q.dtype)  # another micro-batch: rebuilt
    assert other[0] is not first[0]
    torch.testing.assert_close(other[0], first[0])


def test_bad_inputs_name_the_mismatch():
    freqs = _freqs(8, 8)
    with pytest.raises(ValueError, match="context parallelism"):
        rope.packed_rope(torch.zeros(4, 1, 8), torch.tensor([0, 4], dtype=torch.int32), freqs, cp_size=2)
    with pytest.raises(ValueError, match="cu_seqlens ends at 5, the tensor has 4 rows"):
        rope.packed_rope(torch.zeros(4, 1, 8), torch.tensor([0, 5], dtype=torch.int32), freqs)


def test_install_fills_megatrons_hooks_and_keeps_filled_ones(monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)
    sentinel = object()
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", sentinel)
    rope.install()
    rope.install()
    assert rope_utils.fused_apply_rotary_pos_emb_thd is rope.packed_rope
    assert rope_utils.fused_apply_rotary_pos_emb is sentinel  # Transformer Engine's, had it been there
