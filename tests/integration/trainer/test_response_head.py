"""The chunked response head (``logprobs.response_log_probs``) against the straightforward
full-logits computation: log-probs, entropy and the gradients w.r.t. the hidden states and the
output weights, with temperature, vocabulary padding, several row chunks, TP=1 and TP=2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn

ATOL = 1e-5  # fp32 on CPU: the same sums in another order
# Gradients here reach ~9; against an fp64 computation both heads stay within ~2e-5 of it.
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows over a 37-token vocabulary: 11 rows take four (the last one partial), so
    the weight gradient sums over chunks."""
    import vime_core.trainer.logprobs as logprobs

    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * 37)


def _inputs(rows=11, hidden=16, padded=40, vocab=37, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype).requires_grad_()
    w = torch.randn(padded, hidden, generator=gen).to(dtype).requires_grad_()
    # targets at both ends of the vocabulary and in between
    targets = torch.cat([torch.tensor([0, vocab - 1, 8, 31]), torch.randint(0, vocab, (rows - 4,), generator=gen)])
    a = torch.randn(rows, generator=gen)  # upstream gradients of the log-probs and the entropy
    b = torch.randn(rows, generator=gen)
    return x, w, targets, a, b


def _full(x, w, targets, vocab, temperature, entropy_grad=True):
    """The full head: every logit, then Megatron's vocabulary-parallel cross-entropy."""
    from vime_core.trainer.logprobs import log_probs_and_entropy

    logits = x @ w.t()
    return log_probs_and_entropy(logits, targets, vocab, temperature, with_entropy=True, entropy_grad=entropy_grad)


def _grads(x, w, lp, ent, a, b):
    loss = (a * lp).sum() + (0.0 if ent is None or not ent.requires_grad else (b * ent).sum())
    gx, gw = torch.autograd.grad(loss, (x, w))
    return gx, gw


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_head_matches_full_logits_with_entropy_grad(single_rank, small_chunks, temperature):
    from vime_core.trainer.logprobs import response_log_probs

    x, w, targets, a, b = _inputs()
    lp, ent = response_log_probs(x, w, targets, 37, temperature, with_entropy=True, entropy_grad=True)
    ref_lp, ref_ent = _full(x, w, targets, 37, temperature)
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    gx, gw = _grads(x, w, lp, ent, a, b)
    ref_gx, ref_gw = _grads(x, w, ref_lp, ref_ent, a, b)
    torch.testing.assert_close(gx, ref_gx, **GRAD_TOL)
    torch.testing.assert_close(gw, ref_gw, **GRAD_TOL)
    assert gw[37:].abs().sum() == 0  # vocabulary padding: no gradient
    assert ref_gx.abs().max() > 0.1  # a real signal


def test_metric_entropy_has_no_graph_and_log_prob_grads_match(single_rank, small_chunks):
    from vime_core.trainer.logprobs import response_log_probs

    x, w, targets, a, b = _inputs(seed=1)
    lp, ent = response_log_probs(x, w, targets, 37, 0.9, with_entropy=True, entropy_grad=False)
    ref_lp, ref_ent = _full(x, w, targets, 37, 0.9, entropy_grad=False)
    assert not ent.requires_grad and lp.requires_grad
    torch.testing.assert_close(ent, ref_ent, atol=ATOL, rtol=0)
    gx, gw = _grads(x, w, lp, None, a, b)
    ref_gx, ref_gw = _grads(x, w, ref_lp, None, a, b)
    torch.testing.assert_close(gx, ref_gx, **GRAD_TOL)
    torch.testing.assert_close(gw, ref_gw, **GRAD_TOL)


def test_without_entropy_and_under_no_grad(single_rank, small_chunks):
    from vime_core.trainer.logprobs import response_log_probs

    x, w, targets, _, _ = _inputs(seed=2)
    with torch.no_grad():
        lp, ent = response_log_probs(x, w, targets, 37, 1.3)
        ref_lp, _ = _full(x, w, targets, 37, 1.3)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, ref_lp, atol=ATOL, rtol=0)


def test_one_chunk_and_peaked_rows(single_rank):
    """Default chunk size (all rows in one chunk) and near one-hot distributions, where the
    entropy is a small difference of large terms."""
    from vime_core.trainer.logprobs import response_log_probs

    x, w, targets, a, b = _inputs(seed=3)
    with torch.no_grad():
        x.mul_(20)  # logits of order 100: p is nearly one-hot
    lp, ent = response_log_probs(x, w, targets, 37, 1.0, with_entropy=True)
    ref_lp, ref_ent = _full(x, w, targets, 37, 1.0)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-6)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)
    assert (ent >= 0).all()
    for ours, ref in zip(_grads(x, w, lp, ent, a, b), _grads(x, w, ref_lp, ref_ent, a, b)):
        # weight gradients reach ~200 here; both heads are within ~2e-6 of it from an fp64 run
        torch.testing.assert_close(ours, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


def test_bf16_follows_the_full_head(single_rank, small_chunks):
    """bf16 weights and states: logits rounded to bf16 by the matmul, softmax in fp32, as the
    full head does; the gradients are rounded to bf16 before the backward matmuls in both."""
    from vime_core.trainer.logprobs import response_log_probs

    x, w, targets, a, b = _inputs(dtype=torch.bfloat16, seed=4)
    lp, ent = response_log_probs(x, w, targets, 37, 0.7, with_entropy=True)
    ref_lp, ref_ent = _full(x, w, targets, 37, 0.7)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-4, rtol=0)
    gx, gw = _grads(x, w, lp, ent, a, b)
    ref_gx, ref_gw = _grads(x, w, ref_lp, ref_ent, a, b)
    assert gx.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    # bf16 has 8 bits of mantissa; g_W adds the chunks' bf16 products in fp32 (the full head: one product)
    torch.testing.assert_close(gx.float(), ref_gx.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gw.float(), ref_gw.float(), atol=1e-2, rtol=1e-2)


def _megatron_model(ckpt):
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    seed_everything(0)
    arch = architecture_from_hf(read_hf_config(ckpt))
    model = build_gpt_model(arch, tp_size=1)
    load_hf_into_model(model, ckpt, arch, tp=1, rank=0)
    return model, arch


def _param_grads(model, fn):
    model.zero_grad(set_to_none=True)
    lp, ent = fn()
    gen = torch.Generator().manual_seed(9)
    loss = (torch.randn(lp.shape, generator=gen) * lp).sum() + (torch.randn(ent.shape, generator=gen) * ent).sum()
    loss.backward()
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("llama", False)])
def test_model_head_matches_full_logits_head(single_rank, cache_dir, small_chunks, family, tie):
    """The whole model: final hidden states + chunked head == logits + full head, including
    every parameter's gradient (the tied embedding gets both its uses)."""
    from vime_core.trainer.logprobs import packed_response_log_probs, packed_response_log_probs_full
    from vime_core.trainer.packing import pack_samples

    model, arch = _megatron_model(tiny_checkpoint(cache_dir, family, tie))
    gen = torch.Generator().manual_seed(6)
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 6)]
    packed = pack_samples(tokens, [4, 7, 2])
    args = (model, packed, arch.vocab_size, 0.8)
    ours = _param_grads(model, lambda: packed_response_log_probs(*args, with_entropy=True, entropy_grad=True))
    assert model.post_process  # restored after the hidden-states forward
    ref = _param_grads(model, lambda: packed_response_log_probs_full(*args, with_entropy=True, entropy_grad=True))
    torch.testing.assert_close(ours[0], ref[0], atol=ATOL, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=ATOL, rtol=0)
    assert sorted(ours[2]) == sorted(ref[2])
    for name, grad in ref[2].items():
        torch.testing.assert_close(ours[2][name], grad, atol=ATOL, rtol=1e-4, msg=name)


def _tp2_head_worker(rank: int, world_size: int, port: int, out: str) -> None:
    """One TP rank: its half of a 20-row (19 tokens + 1 padding) output weight."""
    torch.set_num_threads(1)
    import vime_core.trainer.logprobs as logprobs
    from vime_core.trainer.parallel import destroy_parallel, init_parallel

    logprobs.CHUNK_ELEMENTS = 20  # chunks of 2 rows (rank 0: 10 real columns, rank 1: 9)
    init_parallel(rank, world_size, "127.0.0.1", port, tp_size=2)
    x, w, targets, a, b = _tp2_inputs()
    w_local = w.detach()[rank * 10 : (rank + 1) * 10].clone().requires_grad_()
    lp, ent = logprobs.response_log_probs(x, w_local, targets, 19, 0.8, with_entropy=True, entropy_grad=True)
    gx, gw = torch.autograd.grad((a * lp).sum() + (b * ent).sum(), (x, w_local))
    torch.save({"lp": lp.detach(), "ent": ent.detach(), "gx": gx, "gw": gw}, Path(out) / f"head{rank}.pt")
    destroy_parallel()


def _tp2_inputs():
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(6, 8, generator=gen) * 2).requires_grad_()
    w = torch.randn(20, 8, generator=gen)
    targets = torch.tensor([0, 9, 10, 18, 3, 14])  # both ranks own some targets
    return x, w, targets, torch.randn(6, generator=gen), torch.randn(6, generator=gen)


@pytest.mark.slow
def test_tp2_head_matches_single_rank_softmax(tmp_path):
    """Two TP ranks (gloo), each with half of the vocabulary, give the single-rank log-softmax,
    entropy and gradients; the padding row gets none."""
    spawn(_tp2_head_worker, 2, str(tmp_path))
    x, w, targets, a, b = _tp2_inputs()
    w = w.requires_grad_()
    logp = ((x @ w[:19].t()) / 0.8).log_softmax(-1)
    ref_lp = logp[torch.arange(6), targets]
    ref_ent = -(logp.exp() * logp).sum(-1)
    ref_gx, ref_gw = torch.autograd.grad((a * ref_lp).sum() + (b * ref_ent).sum(), (x, w))
    for rank in range(2):
        got = torch.load(tmp_path / f"head{rank}.pt")
        torch.testing.assert_close(got["lp"], ref_lp.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got["ent"], ref_ent.detach(), atol=ATOL, rtol=0)
        torch.testing.assert_close(got["gx"], ref_gx, **GRAD_TOL)  # all-reduced over TP
        torch.testing.assert_close(got["gw"], ref_gw[rank * 10 : (rank + 1) * 10], **GRAD_TOL)
    assert torch.load(tmp_path / "head1.pt")["gw"][9].abs().sum() == 0  # id 19: padding


def test_chunk_functions_trace_under_torch_compile():
    """What CUDA runs through torch.compile: dynamo + AOT autograd (the graph inductor lowers)
    give the eager results, for every branch the trainer takes, at two chunk sizes."""
    import vime_core.trainer.logprobs as logprobs

    torch._dynamo.reset()
    fwd = torch.compile(logprobs.forward_chunk, dynamic=True, backend="aot_eager")
    bwd = torch.compile(logprobs.backward_chunk, dynamic=True, backend="aot_eager")
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(37, 16, generator=gen)
    for n in (7, 13):
        x = torch.randn(n, 16, generator=gen)
        local = torch.randint(-5, 42, (n,), generator=gen)  # some targets outside the slice
        lse, ent, g, g_ent = torch.randn(n, generator=gen), torch.rand(n, generator=gen), torch.randn(n), torch.randn(n)
        for temperature, with_entropy in ((1.0, False), (0.7, True)):
            for ours, ref in zip(
                fwd(x, w, local, temperature, with_entropy),
                logprobs.forward_chunk(x, w, local, temperature, with_entropy),
            ):
                assert (ours is None) == (ref is None)
                if ref is not None:
                    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
            for entropy_args in ((None, None), (ent, g_ent)):
                torch.testing.assert_close(
                    bwd(x, w, local, lse, entropy_args[0], g, entropy_args[1], temperature),
                    logprobs.backward_chunk(x, w, local, lse, entropy_args[0], g, entropy_args[1], temperature),
                    atol=1e-5,
                    rtol=1e-5,
                )
    torch._dynamo.reset()


def test_a_failed_compilation_falls_back_to_eager_once(monkeypatch, caplog):
    import vime_core.trainer.compiled as compiled
    import vime_core.trainer.logprobs as logprobs

    attempts = []

    def broken_compile(fn, **kwargs):
        def run(*args):
            attempts.append(fn.__name__)
            raise RuntimeError("no triton here")

        return run

    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_wanted", lambda x, enabled: True)
    monkeypatch.setattr(torch, "compile", broken_compile)
    x, w, targets, _, _ = _inputs(seed=5)
    args = (x.detach(), w.detach(), targets, 1.0, True)
    for _ in range(2):
        out = logprobs.run_chunk_fn(logprobs.forward_chunk, *args)
        for ours, ref in zip(out, logprobs.forward_chunk(*args)):
            torch.testing.assert_close(ours, ref)
    assert attempts == ["forward_chunk"]  # tried once, then eager
    assert "running it eagerly" in caplog.text
