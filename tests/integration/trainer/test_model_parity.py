"""The Megatron model built from an HF checkpoint computes what transformers computes, and the
HF -> Megatron -> HF conversion is exact (TP=1 here; TP=2 in test_distributed.py and test_sharded_checkpoint.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.trainer.conftest import FAMILY_CASES, tiny_checkpoint

# fp32 on CPU: both stacks run the same kernels in nearly the same order; the tolerance allows
# for a different summation order in attention/matmul (observed: 0 to a few 1e-7).
LOGITS_ATOL = 1e-5


def _megatron_model(ckpt, fusions=None):
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    seed_everything(0)
    arch = architecture_from_hf(read_hf_config(ckpt))
    model = build_gpt_model(arch, tp_size=1, fusions=fusions)
    load_hf_into_model(model, ckpt, arch, tp=1, rank=0)
    return model.eval(), arch


@pytest.mark.parametrize("family,tie", FAMILY_CASES)
def test_logits_match_transformers(single_rank, cache_dir, family, tie):
    from transformers import AutoModelForCausalLM

    ckpt = tiny_checkpoint(cache_dir, family, tie)
    model, arch = _megatron_model(ckpt)
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    seq = ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ours = model(ids, torch.arange(seq)[None].expand(2, -1), causal)
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()(ids).logits
    assert ours.shape == ref.shape  # TP=1: no vocabulary padding
    assert ref.abs().max() > 0.1  # a real signal, not two zero tensors
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_packed_log_probs_match_transformers_per_sample(single_rank, cache_dir):
    """Three samples of different lengths packed in one row give each sample's own log-probs."""
    from transformers import AutoModelForCausalLM

    from vime_core.trainer.logprobs import packed_response_log_probs
    from vime_core.trainer.packing import pack_samples

    ckpt = tiny_checkpoint(cache_dir, "qwen2", True)
    model, arch = _megatron_model(ckpt)
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 5)]
    responses = [3, 5, 2]
    temperature = 0.7
    with torch.no_grad():
        ours, entropy = packed_response_log_probs(
            model, pack_samples(tokens, responses), arch.vocab_size, temperature, with_entropy=True
        )
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ref_lp, ref_ent = [], []
    for toks, r in zip(tokens, responses):
        with torch.no_grad():
            logp = (hf(torch.tensor([toks])).logits[0] / temperature).log_softmax(-1)
        pos = torch.arange(len(toks) - r - 1, len(toks) - 1)
        ref_lp.append(logp[pos, torch.tensor(toks)[pos + 1]])
        ref_ent.append(-(logp[pos].exp() * logp[pos]).sum(-1))
    torch.testing.assert_close(ours, torch.cat(ref_lp), atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(entropy, torch.cat(ref_ent), atol=LOGITS_ATOL, rtol=0)


def test_fused_rope_model_equals_the_unfused_one(single_rank, cache_dir, monkeypatch):
    """apply_rope_fusion routes Megatron's attention through vime's packed RoPE (rope.py; eager on
    the CPU): the same log-probs and gradients as Megatron's own unfused RoPE."""
    from vime_core.trainer import rope
    from vime_core.trainer.logprobs import packed_response_log_probs
    from vime_core.trainer.packing import pack_samples

    ckpt = tiny_checkpoint(cache_dir, "qwen3", False)
    gen = torch.Generator().manual_seed(8)
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tokens = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (9, 4, 13)]
    packed = pack_samples(tokens, [4, 2, 6])
    calls, rotate = [], rope.rotate

    def counted(t, cos, sin):
        calls.append(tuple(t.shape))
        return rotate(t, cos, sin)

    monkeypatch.setattr(rope, "rotate", counted)
    results = []
    for fusions in ({"apply_rope_fusion": False}, {"apply_rope_fusion": True}):
        model, arch = _megatron_model(ckpt, fusions)
        assert model.config.apply_rope_fusion == fusions["apply_rope_fusion"]
        lp, _ = packed_response_log_probs(model, packed, arch.vocab_size)
        lp.sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert len(calls) == 2 * arch.num_layers  # q and k in every layer, through the hook
    (lp0, g0), (lp1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-6, rtol=0)
    assert sorted(g0) == sorted(g1)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("family,tie", [("qwen2", True), ("qwen3", False)])
def test_hf_megatron_hf_round_trip_is_exact_tp1(single_rank, cache_dir, family, tie):
    from vime_core.trainer.hf_convert import iter_hf_weights, read_hf_safetensors

    ckpt = tiny_checkpoint(cache_dir, family, tie)
    model, _ = _megatron_model(ckpt)
    source = read_hf_safetensors(ckpt)
    exported = dict(iter_hf_weights(model))
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


def test_vocab_padding_is_masked_and_cut(single_rank, cache_dir):
    """A vocabulary padded by hand (as TP=2 pads 19 -> 20) gets probability 0 on the padding and
    the padding rows never reach HF names."""
    from vime_core.trainer.hf_convert import pad_vocab
    from vime_core.trainer.logprobs import log_probs_and_entropy

    logits = torch.randn(4, 19, generator=torch.Generator().manual_seed(0))
    padded = torch.cat([logits, torch.full((4, 1), 50.0)], dim=1)  # a huge padding logit
    targets = torch.tensor([0, 5, 18, 3])
    lp, ent = log_probs_and_entropy(padded, targets, vocab_size=19, with_entropy=True)
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(lp, ref[torch.arange(4), targets])
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))
    assert pad_vocab(torch.ones(19, 3), 20)[19].abs().sum() == 0


def test_llama3_rope_scaling_matches_transformers(single_rank, cache_dir, tmp_path):
    """Llama 3.1-style RoPE scaling (long wavelengths stretched by `factor`): visible only at
    positions far enough apart, hence a 400-token sequence and a large rope_theta."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "llama3"
    shutil.copytree(tiny_checkpoint(cache_dir, "llama", False), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    model, arch = _megatron_model(ckpt)
    assert arch.rope_scaling_factor == 8.0
    ids = torch.randint(0, arch.vocab_size, (1, 400), generator=torch.Generator().manual_seed(4))
    causal = torch.triu(torch.ones(400, 400, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        ours = model(ids, torch.arange(400)[None], causal)
        ref = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()(ids).logits
        config.pop("rope_scaling")
        (ckpt / "config.json").write_text(json.dumps(config))
        unscaled = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()(ids).logits
    assert (unscaled - ref).abs().max() > 10 * LOGITS_ATOL  # the scaling matters at this length
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)
