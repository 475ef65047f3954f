"""The GPU paths of the trainer's packed forward: FlashAttention's varlen kernel (one call per
layer) against per-segment SDPA, and the whole model with the varlen kernel and the chunked
response head against the per-segment / full-logits path, both in bf16 and both measured
against an fp32 run of the same weights. They run only where CUDA is."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA GPU: the varlen FlashAttention path exists only there (bf16/fp16); "
        "the CPU runs per-segment SDPA, covered by the CPU tests",
    ),
]

# Segments of a real micro-batch's sizes, plus very short ones; one segment per sample.
LENGTHS = [300, 17, 1270, 2, 64, 511, 1023]
HEADS, GROUPS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B: 7 query heads per KV group


def _attention():
    from megatron.core.transformer.enums import AttnMaskType

    from vime_core.trainer.attention import SDPACoreAttention
    from vime_core.trainer.model import HFArchitecture, transformer_config

    arch = HFArchitecture(
        model_type="qwen2",
        vocab_size=1000,
        hidden_size=HEADS * HEAD_DIM,
        num_layers=1,
        num_heads=HEADS,
        num_kv_heads=GROUPS,
        head_dim=HEAD_DIM,
        ffn_hidden_size=512,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling_factor=None,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        qkv_bias=True,
        qk_norm=False,
    )
    return SDPACoreAttention(transformer_config(arch, 1, torch.bfloat16), 1, AttnMaskType.causal, "self")


def _leaves(dtype):
    """q [t, heads, d]; k and v as strided views of one [t, groups, 2d] tensor, as Megatron's split
    of the fused QKV projection hands them over."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype).requires_grad_()
    kv = torch.randn(total, GROUPS, 2 * HEAD_DIM, device="cuda", generator=gen).to(dtype).requires_grad_()
    return q, kv


def _run(fn, q, kv, grad_out):
    out = fn(q, kv[..., :HEAD_DIM], kv[..., HEAD_DIM:])
    dq, dkv = torch.autograd.grad(out, (q, kv), grad_out.to(out.dtype))
    return out.float(), dq.float(), dkv.float()


def test_varlen_attention_matches_per_segment_sdpa(single_rank, monkeypatch):
    from vime_core.trainer.attention import SDPACoreAttention, _varlen_kernel_applies
    from vime_core.trainer.packing import pack_samples

    attn = _attention()
    params = pack_samples([[1] * n for n in LENGTHS], [1] * len(LENGTHS), device="cuda").packed_seq_params()
    assert params.cu_seqlens_device.is_cuda and params.cu_seqlens_device.dtype == torch.int32
    grad_out = torch.randn(sum(LENGTHS), 1, HEADS * HEAD_DIM, device="cuda")

    q16, kv16 = _leaves(torch.bfloat16)
    q32, kv32 = (t.detach().float().requires_grad_() for t in (q16, kv16))
    assert _varlen_kernel_applies(q16) and not _varlen_kernel_applies(q32)
    reference = _run(lambda q, k, v: attn._packed_per_segment(q, k, v, params), q32, kv32, grad_out)
    per_segment = _run(lambda q, k, v: attn._packed_per_segment(q, k, v, params), q16, kv16, grad_out)

    def no_fallback(*args):
        raise AssertionError("bf16 on CUDA must take the varlen kernel")

    monkeypatch.setattr(SDPACoreAttention, "_packed_per_segment", no_fallback)
    varlen = _run(lambda q, k, v: attn(q, k, v, None, packed_seq_params=params), q16, kv16, grad_out)

    for name, ours, old, ref in zip(("out", "dq", "dkv"), varlen, per_segment, reference):
        scale = float(ref.abs().max())
        err, err_old = float((ours - ref).abs().max()), float((old - ref).abs().max())
        assert scale > 0.01, name  # a real signal
        # bf16 kernels: the varlen one as close to the fp32 result as per-segment SDPA (or within 1%)
        assert err <= max(2 * err_old, 0.01 * scale), (name, err, err_old, scale)


def _models(cache_dir, fusions=None):
    from vime_core.demo.model import build_tiny_model
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    ckpt = build_tiny_model(
        cache_dir / "models" / "trainer-gpu-qwen2",
        family="qwen2",
        seed=2,
        hidden_size=HEADS * HEAD_DIM,
        num_layers=2,
        num_heads=HEADS,
        num_kv_heads=GROUPS,
        head_dim=HEAD_DIM,
        intermediate_size=512,
        vocab_size=3000,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    arch = architecture_from_hf(read_hf_config(ckpt))
    m16 = build_gpt_model(arch, 1, torch.bfloat16, "cuda", fusions=fusions)
    load_hf_into_model(m16, ckpt, arch, tp=1, rank=0)
    m32 = build_gpt_model(arch, 1, torch.float32, "cuda")
    with torch.no_grad():  # the fp32 reference runs the bf16 weights exactly
        for p32, p16 in zip(m32.parameters(), m16.parameters()):
            p32.copy_(p16.float())
    return m16, m32, arch


def _forward_backward(model, head, packed, vocab):
    model.zero_grad(set_to_none=True)
    lp, ent = head(model, packed, vocab, 0.9, with_entropy=True, entropy_grad=True)
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(lp.shape, device="cuda", generator=gen)
    b = torch.randn(lp.shape, device="cuda", generator=gen)
    ((a * lp).sum() + (b * ent).sum()).backward()
    grads = {n: p.grad.float().flatten() for n, p in model.named_parameters()}
    return lp.detach().float(), ent.detach().float(), grads


def test_model_new_path_as_close_to_fp32_as_old_path(single_rank, cache_dir, monkeypatch):
    """bf16 model: varlen attention + chunked head (compiled) vs per-segment SDPA + full logits, each
    against the fp32 model (per-segment SDPA, full logits) on the same weights: log-probs,
    entropy and every parameter's gradient."""
    import vime_core.trainer.logprobs as logprobs
    from vime_core.trainer.attention import SDPACoreAttention
    from vime_core.trainer.packing import pack_samples

    m16, m32, arch = _models(cache_dir)
    gen = torch.Generator().manual_seed(4)
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS if n > 2]
    responses = [max(1, len(t) * 3 // 4) for t in tokens]
    packed = pack_samples(tokens, responses, device="cuda")
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 700 * arch.vocab_size)  # chunks of 700 rows, the last partial

    ref = _forward_backward(m32, logprobs.packed_response_log_probs_full, packed, arch.vocab_size)
    new = _forward_backward(m16, logprobs.packed_response_log_probs, packed, arch.vocab_size)
    monkeypatch.setattr(SDPACoreAttention, "_packed", SDPACoreAttention._packed_per_segment)
    old = _forward_backward(m16, logprobs.packed_response_log_probs_full, packed, arch.vocab_size)

    for i, name in enumerate(("log_probs", "entropy")):
        err, err_old = float((new[i] - ref[i]).abs().max()), float((old[i] - ref[i]).abs().max())
        assert err <= max(2 * err_old, 0.02), (name, err, err_old)
    assert sorted(new[2]) == sorted(ref[2])
    total = lambda g: torch.cat([g[n] for n in sorted(g)])  # noqa: E731
    norm = float(total(ref[2]).norm())
    err, err_old = (
        float((total(new[2]) - total(ref[2])).norm()) / norm,
        float((total(old[2]) - total(ref[2])).norm()) / norm,
    )
    assert err <= max(2 * err_old, 0.01), ("gradients", err, err_old)
    for n, g in ref[2].items():  # no parameter far off (a missing or doubled gradient would be ~100%)
        scale = float(g.norm()) + 1e-12
        err, err_old = float((new[2][n] - g).norm()) / scale, float((old[2][n] - g).norm()) / scale
        assert err <= max(3 * err_old, 0.05), (n, err, err_old)


def test_fused_rope_and_swiglu_as_close_to_fp32_as_unfused(single_rank, cache_dir):
    """bf16 model with vime's packed RoPE and Megatron's compiled SwiGLU against the same bf16
    model unfused, each against the fp32 (unfused) model on the same weights: log-probs,
    entropy and every parameter's gradient."""
    import vime_core.trainer.logprobs as logprobs
    from vime_core.trainer import rope
    from vime_core.trainer.packing import pack_samples

    m16, m32, arch = _models(cache_dir)
    gen = torch.Generator().manual_seed(6)
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS if n > 2]
    packed = pack_samples(tokens, [max(1, len(t) * 3 // 4) for t in tokens], device="cuda")
    head = logprobs.packed_response_log_probs
    ref = _forward_backward(m32, head, packed, arch.vocab_size)
    unfused = _forward_backward(m16, head, packed, arch.vocab_size)
    rope.install()
    m16.config.apply_rope_fusion = m16.config.bias_activation_fusion = True
    calls, rotate = [], rope.rotate
    rope.rotate = lambda t, cos, sin: calls.append(1) or rotate(t, cos, sin)  # noqa: E731  (compiled anew)
    try:
        fused = _forward_backward(m16, head, packed, arch.vocab_size)
    finally:
        rope.rotate = rotate
    assert calls, "the fused RoPE was not called"
    for i, name in enumerate(("log_probs", "entropy")):
        err, err_unfused = float((fused[i] - ref[i]).abs().max()), float((unfused[i] - ref[i]).abs().max())
        assert err <= max(2 * err_unfused, 0.02), (name, err, err_unfused)
    total = lambda g: torch.cat([g[n] for n in sorted(g)])  # noqa: E731
    norm = float(total(ref[2]).norm())
    err = float((total(fused[2]) - total(ref[2])).norm()) / norm
    err_unfused = float((total(unfused[2]) - total(ref[2])).norm()) / norm
    assert err <= max(2 * err_unfused, 0.01), ("gradients", err, err_unfused)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"loss_agg_mode": "seq_mean_token_mean"}, {"advantage_estimator": "gspo"}],
    ids=["default", "seq-mean", "gspo"],
)
def test_micro_batch_loop_does_not_sync(single_rank, cache_dir, overrides):
    """A micro-batch's packing, forward, loss and backward queue GPU work without waiting for it
    (no .item(), no blocking copy): CUDA's sync debug mode turns any sync into an error, naming
    the op. Once warmed up (the first call compiles the response head). Also for the losses
    that aggregate per sequence (their sequence ids go to the device)."""
    from vime_core.config.loader import load_config
    from vime_core.trainer import train_step
    from vime_core.trainer.model import fusion_settings

    cfg = load_config(None, overrides)
    model, _, arch = _models(cache_dir, fusion_settings(cfg, "cuda"))  # the run's kernels
    gen = torch.Generator().manual_seed(5)
    lengths = [(40, 200), (300, 500), (17, 90)]
    batch = {
        "tokens": [torch.randint(3, arch.vocab_size, (p + r,), generator=gen).tolist() for p, r in lengths],
        "response_length": [r for _, r in lengths],
        "loss_mask": [[1] * (r - 3) + [0] * 3 for _, r in lengths],
        "rollout_log_probs": [(-torch.rand(r, generator=gen)).tolist() for _, r in lengths],
    }
    indices = list(range(len(lengths)))
    inputs = train_step.StepInputs(
        batch=batch,
        micro_batches=[indices],
        denominators=train_step.StepDenominators.of(batch, indices),
        advantages={i: torch.full((r,), 0.5 - i) for i, (_, r) in enumerate(lengths)},
        old_log_probs=None,
    )

    def micro_batch():
        mb = train_step.make_micro_batch(batch, indices, torch.device("cuda"))
        loss = train_step.micro_batch_loss(model, mb, inputs, cfg, arch.vocab_size, train_step._Accumulator())
        loss.backward()

    micro_batch()
    torch.cuda.synchronize()
    sites = _sync_sites(micro_batch)
    assert not sites, f"{len(sites)} synchronizing call(s):\n\n" + "\n\n".join(sites)
    torch.cuda.synchronize()


def test_sync_sites_sees_a_sync_and_nothing_else():
    """The detector of the test above: a host read-back is found, a plain warning is not."""
    import warnings

    x = torch.ones(4, device="cuda")

    def reads_back():
        warnings.warn("not a sync", DeprecationWarning)
        (x * 2).sum().item()

    assert len(_sync_sites(reads_back)) == 1
    assert _sync_sites(lambda: warnings.warn("not a sync", DeprecationWarning)) == []


def _sync_sites(fn) -> list[str]:
    """Every synchronizing CUDA call `fn` makes, each with the Python stack that made it (CUDA's
    sync debug mode in "warn": all of them in one run, where "error" stops at the first)."""
    import traceback
    import warnings

    sites: list[str] = []

    def record(message, category, filename, lineno, file=None, line=None):
        # only the sync warnings: others raised meanwhile (Megatron's deprecations, the debug
        # mode's own "prototype feature" notice) are not synchronizing calls
        if "called a synchronizing CUDA operation" in str(message):
            sites.append(f"{message}\n" + "".join(traceback.format_stack(limit=14)[:-1]))

    with warnings.catch_warnings():  # restores showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sites
