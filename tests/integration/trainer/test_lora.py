"""LoRA on the trainer (CPU, gloo): TP=2 against TP=1 with the same whole adapters (outputs and
gradients), only the adapters train and hold optimizer state, the KL reference is the policy with
its adapters off, the published weights are the merged W + s B A, and a checkpoint holds the
adapters without the frozen base, resumes them and their Adam state bit for bit, and is refused on
another base."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.trainer.conftest import tiny_checkpoint
from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.hand_batch import hand_batch, single_rank_trainer
from tests.integration.trainer.lora_workers import (
    PEFT_PREFIX,
    forward_backward,
    load_adapters,
    lora_config,
    seeded_adapters,
    tp_forward_backward,
    train_adapters,
)

# Same math, another reduction order (TP splits the matmuls, the vocabulary and the rank-r sums).
ATOL = 2e-5
# Adapters after two Adam steps: where a gradient is ~0, m / (sqrt(v) + eps) amplifies
# reduction-order noise (as in test_distributed.py).
WEIGHT_ATOL = 1e-4


@pytest.fixture(scope="module")
def ckpt(cache_dir):
    return tiny_checkpoint(cache_dir, "qwen2", False)  # q/k/v biases, untied head


def _merged_from_peft(source, peft, scale):
    """W + s B A of every adapted HF weight, from the checkpoint and the PEFT tensors."""
    merged = {}
    for name, a in peft.items():
        if name.endswith(".lora_A.weight"):
            hf = "model.layers." + name[len(PEFT_PREFIX) : -len(".lora_A.weight")] + ".weight"
            b = peft[name.replace("lora_A", "lora_B")]
            merged[hf] = source[hf] + scale * b @ a
    return merged


def test_tp2_outputs_and_gradients_equal_tp1(single_rank, ckpt, tmp_path):
    from vime_core.trainer.hf_convert import read_hf_safetensors
    from vime_core.trainer.lora import lora_hf_state

    trainer = single_rank_trainer(lora_config(ckpt, tmp_path / "tp1"))
    initial = lora_hf_state(trainer.model, trainer.arch)
    load_adapters(trainer, seeded_adapters(trainer.arch, 4, seed=3))
    want = forward_backward(trainer, hand_batch())
    want_hf = dict(trainer.iter_hf_weights())
    want_trained = train_adapters(trainer)

    spawn(tp_forward_backward, 2, str(ckpt), str(tmp_path / "tp2"), str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for got in ranks:
        # the seed-derived initial A (and zero B) is the same whole tensor at any TP size
        assert initial.keys() == got["initial"].keys()
        assert all(torch.equal(got["initial"][n], t) for n, t in initial.items())
        assert all(torch.equal(got["peft"][n], t) for n, t in seeded_adapters(trainer.arch, 4, seed=3).items())
        torch.testing.assert_close(got["log_probs"], want["log_probs"], atol=ATOL, rtol=0)
        assert got["grads"].keys() == want["grads"].keys()
        for name, grad in want["grads"].items():
            assert grad.abs().max() > 0, name  # every adapter gets a gradient
            torch.testing.assert_close(got["grads"][name], grad, atol=ATOL, rtol=1e-4, msg=name)
        for name, tensor in want_hf.items():
            torch.testing.assert_close(got["hf"][name], tensor, atol=ATOL, rtol=0, msg=name)
        # two Adam steps: the grad norm counts each adapter once (its TP split tagged), so the
        # clipping and the steps are TP=1's
        trained = got["trained"]
        assert trained["loss"] == pytest.approx(want_trained["loss"], abs=ATOL)
        assert trained["grad_norm"] == pytest.approx(want_trained["grad_norm"], rel=1e-4)
        for name, tensor in want_trained["peft"].items():
            torch.testing.assert_close(trained["peft"][name], tensor, atol=WEIGHT_ATOL, rtol=0, msg=name)
    # the merged weights are W + s B A of the PEFT tensors
    source = read_hf_safetensors(ckpt)
    for name, tensor in _merged_from_peft(source, seeded_adapters(trainer.arch, 4, seed=3), 8.0 / 4).items():
        torch.testing.assert_close(want_hf[name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def _adam_state_bytes(optimizer) -> int:
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return sum(
        t.numel() * t.element_size()
        for part in parts
        for state in part.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


def test_only_adapters_train_and_hold_optimizer_state(single_rank, ckpt, tmp_path):
    from vime_core.trainer.hf_convert import read_hf_safetensors

    full = single_rank_trainer(lora_config(ckpt, tmp_path / "full", lora_rank=0, lora_alpha=16.0))
    full.train(0, hand_batch())
    lora = single_rank_trainer(lora_config(ckpt, tmp_path / "lora"))
    base = {n: p.detach().clone() for n, p in lora.model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in lora.model.named_parameters() if p.requires_grad}
    lora.train(0, hand_batch())

    n_full = sum(p.numel() for p in full.model.parameters())
    n_lora = sum(t.numel() for t in adapters.values())
    # Adam keeps two fp32 moments per trained parameter; DDP's fp32 gradient buffer one gradient
    full_bytes, lora_bytes = _adam_state_bytes(full.optimizer), _adam_state_bytes(lora.optimizer)
    print(f"optimizer state: full {full_bytes} B, LoRA r=4 {lora_bytes} B ({n_lora} of {n_full} parameters)")
    assert full_bytes == 2 * 4 * n_full and lora_bytes == 2 * 4 * n_lora
    assert sum(b.grad_data.numel() for b in lora.model.buffers) == n_lora

    after = dict(lora.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base is frozen
    assert all(not torch.equal(after[n], t) for n, t in adapters.items() if n.endswith(".B"))
    source = read_hf_safetensors(ckpt)
    published = dict(lora.iter_hf_weights())
    changed = {n for n, t in published.items() if not torch.equal(t, source[n])}
    assert changed == {n for n in source if n.endswith("_proj.weight")}  # merged adapters, nothing else


def test_the_kl_reference_is_the_policy_with_adapters_off(single_rank, ckpt, tmp_path):
    from vime_core.trainer.lora import adapters_disabled

    cfg = lora_config(ckpt, tmp_path, use_kl_loss=True, kl_loss_coef=0.1)
    trainer = single_rank_trainer(cfg)
    assert trainer.ref_model is None and trainer.ref_is_base_model
    initial = trainer.compute_log_probs(hand_batch())
    first = trainer.train(0, hand_batch())
    second = trainer.train(1, hand_batch())
    # rollout 0's first step: policy == base, so KL 0; afterwards the adapters moved away from it
    assert first["kl"] < second["kl"] and second["kl"] > 0
    moved = trainer.compute_log_probs(hand_batch())
    assert max(abs(a - b) for x, y in zip(moved, initial) for a, b in zip(x, y)) > 1e-4
    with adapters_disabled(trainer.model):
        assert trainer.compute_log_probs(hand_batch()) == initial


def test_resume_restores_adapters_and_their_adam_state_bit_for_bit(single_rank, ckpt, tmp_path):
    from vime_core.trainer.lora import lora_hf_state

    cfg = lora_config(ckpt, tmp_path)  # two steps per rollout: Adam state after the first rollout
    first = single_rank_trainer(cfg)
    first.train(0, hand_batch())
    path = first.save(0)
    uninterrupted = first.train(1, hand_batch(scale=0.5))
    want = lora_hf_state(first.model, first.arch)

    second = single_rank_trainer(cfg)
    second.load(path)
    resumed = second.train(1, hand_batch(scale=0.5))
    got = lora_hf_state(second.model, second.arch)
    assert want.keys() == got.keys() and all(torch.equal(got[n], t) for n, t in want.items())
    for name, tensor in second.iter_hf_weights():
        assert torch.equal(tensor, dict(first.iter_hf_weights())[name]), name
    for key in ("loss", "pg_loss", "grad_norm"):
        assert resumed[key] == uninterrupted[key] and math.isfinite(resumed[key]), key


def test_deferred_merged_weights_equal_the_merged_ones(single_rank, ckpt, tmp_path):
    """A publish's merged weights made bucket by bucket (defer_merge) are the eager iterator's,
    name for name, and only an adapted layer's come deferred."""
    from vime_core.trainer.hf_convert import iter_hf_weights
    from vime_core.weight_sync.buckets import DeferredTensor, iter_buckets

    trainer = single_rank_trainer(lora_config(ckpt, tmp_path))
    trainer.train(0, hand_batch())  # B no longer zero: merged != base
    eager = dict(trainer.iter_hf_weights())
    lazy = list(iter_hf_weights(trainer.model, trainer.arch, defer_merge=True))
    assert [n for n, _ in lazy] == list(eager)
    deferred = {n for n, t in lazy if isinstance(t, DeferredTensor)}
    assert deferred == {n for n in eager if n.endswith("_proj.weight")}  # every linear (all-linear), no bias
    for name, t in lazy:
        assert (tuple(t.shape), t.dtype) == (tuple(eager[name].shape), eager[name].dtype), name
    made = {n: t for b in iter_buckets(lazy, 1 << 12) for n, t in zip(b.names, b.tensors)}
    assert made.keys() == eager.keys() and all(torch.equal(made[n], eager[n]) for n in eager)


def test_a_checkpoint_holds_the_adapters_not_the_frozen_base(single_rank, ckpt, tmp_path):
    from vime_core.trainer.checkpoint import rank_file_name
    from vime_core.trainer.hf_convert import unwrap
    from vime_core.trainer.lora import ADAPTER_KEYS, base_fingerprint, frozen_names

    trainer = single_rank_trainer(lora_config(ckpt, tmp_path))
    trainer.train(0, hand_batch())
    saved = torch.load(f"{trainer.save(0)}/{rank_file_name(0)}", weights_only=False)
    frozen = frozen_names(trainer.model)
    assert frozen and not frozen & saved["model"].keys()
    adapters = {n for n, p in unwrap(trainer.model).named_parameters() if p.requires_grad}
    assert adapters and adapters <= saved["model"].keys() and all(n.endswith(ADAPTER_KEYS) for n in adapters)
    # the base's fingerprint: the float64 sum and sum of squares of every frozen tensor
    weights = [p.detach().double() for n, p in unwrap(trainer.model).named_parameters() if n in frozen]
    want = [sum(float(w.sum()) for w in weights), sum(float(w.square().sum()) for w in weights)]
    assert saved["lora_base_fingerprint"] == pytest.approx(want, rel=1e-12)
    assert base_fingerprint(trainer.model) == pytest.approx(want, rel=1e-12)


def test_adapters_on_another_base_model_are_refused_in_one_line(single_rank, ckpt, tmp_path):
    from vime_core.demo.model import build_tiny_model

    saved = single_rank_trainer(lora_config(ckpt, tmp_path)).save(0)
    # the same shape and LoRA settings, other base weights
    other = build_tiny_model(
        tmp_path / "other-base", family="qwen2", seed=2, tie_word_embeddings=False, num_heads=4, num_kv_heads=2
    )
    with pytest.raises(ValueError) as err:
        single_rank_trainer(lora_config(other, tmp_path / "other")).load(saved)
    assert len(str(err.value).splitlines()) == 1, err.value
    assert saved in str(err.value) and "trained on another base model" in str(err.value)


def test_a_checkpoint_with_other_adapters_is_refused_in_one_line(single_rank, ckpt, tmp_path):
    saved = single_rank_trainer(lora_config(ckpt, tmp_path)).save(0)
    for over, held in (
        ({"lora_rank": 0, "lora_alpha": 16.0}, "adapters of rank 4 on 8 layers"),
        ({"lora_rank": 8}, "adapters of rank 4 on 8 layers"),
    ):
        with pytest.raises(ValueError) as err:
            single_rank_trainer(lora_config(ckpt, tmp_path / "other", **over)).load(saved)
        assert len(str(err.value).splitlines()) == 1 and held in str(err.value), err.value
        assert f"lora_rank={over['lora_rank']}" in str(err.value)


def test_the_peft_export_loads_in_peft_with_the_merged_exports_logits(single_rank, ckpt, tmp_path):
    """`export_peft` writes the trained adapter as a PEFT folder: `PeftModel.from_pretrained` on the
    HF base gives the logits of the merged HF export (`export_hf`: W + s B A) of the same trainer."""
    peft = pytest.importorskip("peft", reason="peft is in the trainer lock; a bare environment lacks it")
    from transformers import AutoModelForCausalLM

    trainer = single_rank_trainer(lora_config(ckpt, tmp_path / "run"))
    trainer.train(0, hand_batch())  # B moves off zero: the adapter changes the logits
    merged_dir = trainer.export_hf(str(tmp_path / "merged"))
    adapter_dir = trainer.export_peft(str(tmp_path / "adapter"))

    base = AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.float32)
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
        peft_logits = adapted(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged_dir, torch_dtype=torch.float32)(ids).logits
    effect = (merged_logits - base_logits).abs().max().item()
    assert effect > 1e-4, "the trained adapter should change the logits"
    assert (peft_logits - merged_logits).abs().max().item() < max(1e-4, 1e-3 * effect)


def test_export_peft_without_lora_is_refused_in_one_line(single_rank, ckpt, tmp_path):
    trainer = single_rank_trainer(lora_config(ckpt, tmp_path / "full", lora_rank=0, lora_alpha=16.0))
    with pytest.raises(ValueError, match="lora_rank=0"):
        trainer.export_peft(str(tmp_path / "adapter"))
