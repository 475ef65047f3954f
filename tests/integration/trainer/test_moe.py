"""Qwen3-MoE and Mixtral on the Megatron actor (TP=1): the Megatron MoE model built from a tiny random HF
checkpoint computes what transformers computes, HF -> Megatron -> HF is exact, and a GRPO step
through the real trainer moves the router and the experts it routed to."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer
from tests.moe_tiny import tiny_mixtral_checkpoint, tiny_moe_checkpoint

# fp32 on CPU, as test_model_parity.py: the same kernels, a different summation order.
LOGITS_ATOL = 1e-5


def _checkpoint(cache_dir, family: str):
    return tiny_mixtral_checkpoint(cache_dir) if family == "mixtral" else tiny_moe_checkpoint(cache_dir)


def _megatron_model(ckpt):
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    seed_everything(0)
    arch = architecture_from_hf(read_hf_config(ckpt))
    model = build_gpt_model(arch, tp_size=1)
    load_hf_into_model(model, ckpt, arch, tp=1, rank=0)
    return model.eval(), arch


def _logits(model, ids):
    seq = ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        return model(ids, torch.arange(seq)[None].expand(ids.shape[0], -1), causal)


def _hf_logits(ckpt, ids, **config_changes):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **config_changes).eval()
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_logits_match_transformers(single_rank, cache_dir, norm_topk_prob):
    ckpt = tiny_moe_checkpoint(cache_dir, norm_topk_prob)
    model, arch = _megatron_model(ckpt)
    assert (arch.num_experts, arch.moe_router_topk, arch.norm_topk_prob) == (8, 2, norm_topk_prob)
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    ours = _logits(model, ids)
    ref = _hf_logits(ckpt, ids)
    # the routing weights matter: the other normalisation gives other logits
    other = _hf_logits(ckpt, ids, norm_topk_prob=not norm_topk_prob)
    assert (other - ref).abs().max() > 10 * LOGITS_ATOL
    assert ours.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_mixtral_logits_match_transformers(single_rank, cache_dir):
    """Mixtral: Llama attention (no q/k norms), softmax over all experts then the top k renormalised."""
    ckpt = tiny_mixtral_checkpoint(cache_dir)
    model, arch = _megatron_model(ckpt)
    assert (arch.model_type, arch.num_experts, arch.moe_router_topk, arch.qk_norm) == ("mixtral", 8, 2, False)
    ids = torch.randint(0, arch.vocab_size, (2, 11), generator=torch.Generator().manual_seed(3))
    ours = _logits(model, ids)
    ref = _hf_logits(ckpt, ids)
    assert (_hf_logits(ckpt, ids, num_experts_per_tok=1) - ref).abs().max() > 10 * LOGITS_ATOL  # routing matters
    assert ours.shape == ref.shape and ref.abs().max() > 0.1
    torch.testing.assert_close(ours, ref, atol=LOGITS_ATOL, rtol=0)


def test_moe_packed_log_probs_match_transformers(single_rank, cache_dir):
    """Samples packed in one row (the trainer's path) get each sample's own log-probs."""
    from vime_core.trainer.logprobs import packed_response_log_probs
    from vime_core.trainer.packing import pack_samples

    ckpt = tiny_moe_checkpoint(cache_dir)
    model, arch = _megatron_model(ckpt)
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(3, arch.vocab_size, (n,), generator=gen).tolist() for n in (7, 12, 5)]
    responses = [3, 5, 2]
    with torch.no_grad():
        ours, _ = packed_response_log_probs(model, pack_samples(tokens, responses), arch.vocab_size)
    ref = []
    for toks, r in zip(tokens, responses):
        logp = _hf_logits(ckpt, torch.tensor([toks]))[0].log_softmax(-1)
        pos = torch.arange(len(toks) - r - 1, len(toks) - 1)
        ref.append(logp[pos, torch.tensor(toks)[pos + 1]])
    torch.testing.assert_close(ours, torch.cat(ref), atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize(
    "family,expert_weight",
    [
        ("qwen3_moe", "model.layers.1.mlp.experts.7.down_proj.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.7.w2.weight"),
    ],
)
def test_moe_hf_megatron_hf_round_trip_is_exact(single_rank, cache_dir, family, expert_weight):
    """The exported names and tensors are those save_pretrained wrote."""
    from vime_core.trainer.hf_convert import iter_hf_weights, read_hf_safetensors

    ckpt = _checkpoint(cache_dir, family)
    model, _ = _megatron_model(ckpt)
    source = read_hf_safetensors(ckpt)
    exported = dict(iter_hf_weights(model))
    assert sorted(exported) == sorted(source)
    assert expert_weight in exported
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(
    "family,block,down", [("qwen3_moe", "mlp", "down_proj"), ("mixtral", "block_sparse_moe", "w2")]
)
def test_moe_training_step_moves_router_and_experts(single_rank, cache_dir, tmp_path, family, block, down):
    """One rollout of GRPO through MegatronTrainer: log-probs move with the advantage's sign, and
    every layer's router and experts change."""
    ckpt = _checkpoint(cache_dir, family)
    trainer = single_rank_trainer(hand_config(ckpt, tmp_path, num_steps_per_rollout=1))
    before_w = {n: t.clone() for n, t in trainer.iter_hf_weights()}
    batch = hand_batch()
    before = trainer.compute_log_probs(batch)
    metrics = trainer.train(0, batch)
    after = trainer.compute_log_probs(batch)
    assert metrics["grad_norm"] > 0
    for adv, b, a in zip(batch["advantage"], before, after):
        deltas = [y - x for x, y in zip(b, a)]
        assert all(d > 0 for d in deltas) if adv > 0 else all(d < 0 for d in deltas), (adv, deltas)
    after_w = dict(trainer.iter_hf_weights())
    changed = {n for n in before_w if not torch.equal(before_w[n], after_w[n])}
    for layer in range(2):
        assert f"model.layers.{layer}.{block}.gate.weight" in changed
        experts = [f"model.layers.{layer}.{block}.experts.{e}.{down}.weight" for e in range(8)]
        assert any(name in changed for name in experts), layer


def test_lora_on_an_moe_model_is_refused_in_one_line(single_rank, cache_dir, tmp_path):
    ckpt = tiny_moe_checkpoint(cache_dir)
    with pytest.raises(ValueError, match="LoRA on mixture-of-experts layers is not supported"):
        single_rank_trainer(hand_config(ckpt, tmp_path, lora_rank=4, lora_alpha=8.0))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_grouped_experts_compute_what_one_mlp_per_expert_computes(single_rank, cache_dir, family, monkeypatch):
    """The grouped-GEMM experts (trainer/grouped_experts.py) on the same parameters as SequentialMLP:
    the same logits and every parameter's gradient, within fp32's summation-order tolerance."""
    from vime_core.trainer.compat_cpu import seed_everything
    from vime_core.trainer.grouped_experts import GroupedMLP
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    ckpt = _checkpoint(cache_dir, family)
    arch = architecture_from_hf(read_hf_config(ckpt))
    models = {}
    for grouped in (False, True):
        seed_everything(0)
        models[grouped] = build_gpt_model(arch, tp_size=1, grouped=grouped)
        load_hf_into_model(models[grouped], ckpt, arch, tp=1, rank=0)
    experts = [m for m in models[True].modules() if isinstance(m, GroupedMLP)]
    assert len(experts) == arch.num_layers and all(e.grouped() for e in experts)
    assert not any(isinstance(m, GroupedMLP) for m in models[False].modules())

    launches = []
    grouped_mm = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: launches.append(1) or grouped_mm(*a, **k))
    ids = torch.randint(0, arch.vocab_size, (2, 13), generator=torch.Generator().manual_seed(5))
    seq = ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    weights = torch.randn(2, seq, models[True].vocab_size, generator=torch.Generator().manual_seed(6))
    logits = {}
    for grouped, model in models.items():
        logits[grouped] = model(ids, torch.arange(seq)[None].expand(2, -1), causal)
        (logits[grouped] * weights).sum().backward()
    assert len(launches) == 2 * arch.num_layers  # fc1 and fc2 of each MoE layer, one launch each
    torch.testing.assert_close(logits[True], logits[False], atol=LOGITS_ATOL, rtol=0)
    grads = {grouped: dict(model.named_parameters()) for grouped, model in models.items()}
    expert_grads = 0
    for name, param in grads[False].items():
        if param.grad is None:
            continue
        torch.testing.assert_close(grads[True][name].grad, param.grad, atol=1e-5, rtol=1e-5, msg=name)
        expert_grads += "local_experts" in name and bool(param.grad.abs().max() > 0)
    assert expert_grads > arch.num_layers  # routed experts got gradients, each its own
