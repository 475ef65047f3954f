"""Routing replay on the trainer's models (tiny Qwen3-MoE, one gloo rank, CPU): replaying the
trainer's own routing changes nothing (logits and gradients), replaying other experts changes the
logits, the router's gradient under replay is the one of the routing written out here,

    p_t = softmax(z_t[e_t1], ..., z_t[e_tk]),  z_t = h_t W_router^T  (norm_topk_prob)

and after the context, or in the reference model built beside the policy, the routers route by
themselves."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_replay import RouterReplay

from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer
from tests.moe_tiny import tiny_moe_checkpoint
from vime_core.data import routed_experts
from vime_core.trainer.logprobs import forward_packed
from vime_core.trainer.packing import pack_samples
from vime_core.trainer.routing_replay import ExpertAgreement, recording, replaying, routers
from vime_core.trainer.train_step import EXPERT_AGREEMENT, forward_log_probs, make_micro_batch


@pytest.fixture(scope="module")
def trainer(single_rank, cache_dir, tmp_path_factory):
    """The real trainer with the flag on and a reference model (use_kl_loss) built in the same process."""
    ckpt = tiny_moe_checkpoint(cache_dir)
    cfg = hand_config(ckpt, tmp_path_factory.mktemp("replay"), use_kl_loss=True, kl_loss_coef=0.1, use_router=False)
    cfg.use_rollout_routing_replay = True
    trainer = single_rank_trainer(cfg)
    assert trainer.ref_model is not None
    return trainer


@pytest.fixture(scope="module")
def packed():
    batch = hand_batch()
    return pack_samples(batch["tokens"], batch["response_length"])


def _logits(model, packed):
    with torch.no_grad():
        return forward_packed(model, packed)


def _untouched(router):
    replay = router.router_replay
    return replay.target_topk_idx is None and replay.replay_backward_list == [] and replay.router_replay_action is None


def test_each_model_has_its_own_routers(trainer):
    policy, ref = routers(trainer.model), routers(trainer.ref_model)
    layers = trainer.arch.num_layers
    assert [r.layer_number for r in policy] == [r.layer_number for r in ref] == list(range(1, layers + 1))
    assert all(r.router_replay is not None for r in policy + ref)
    assert not {id(r) for r in policy} & {id(r) for r in ref}
    # Megatron's static list holds both models' routers (at least): the trap routers() avoids
    assert len(RouterReplay.global_router_replay_instances) >= len(policy) + len(ref)


def test_replay_own_routing_other_routing_and_back(trainer, packed):
    model, arch = trainer.model, trainer.arch
    before = _logits(model, packed)
    with recording(model) as record:
        recorded = _logits(model, packed)
    chosen = record.experts()
    tokens = packed.input_ids.shape[1]
    assert chosen.shape == (tokens, arch.num_layers, arch.moe_router_topk) and chosen.dtype == torch.int64
    assert torch.equal(recorded, before)

    # (a) the trainer's own choice replayed: the same logits, bit for bit
    with replaying(model, chosen.to(torch.uint8)):  # the engine's dtype for <= 256 experts
        assert torch.equal(_logits(model, packed), before)

    # (b) every token's experts rotated by one: other logits
    rotated = (chosen + 1) % arch.num_experts
    with replaying(model, rotated):
        other = _logits(model, packed)
    assert (other - before).abs().max() > 1e-3 * before.abs().max()
    with replaying(model, rotated.to(torch.uint16)):  # the engine's dtype above 256 experts
        assert torch.equal(_logits(model, packed), other)

    # (d) after the contexts the model routes by itself again, and no replay state is left
    assert torch.equal(_logits(model, packed), before)
    assert all(_untouched(r) for r in routers(model))


def test_the_reference_model_is_unaffected_by_the_policys_replay(trainer, packed):
    ref_before = _logits(trainer.ref_model, packed)
    with recording(trainer.model) as record:
        _logits(trainer.model, packed)
    rotated = (record.experts() + 1) % trainer.arch.num_experts
    with replaying(trainer.model, rotated):
        assert all(_untouched(r) for r in routers(trainer.ref_model))
        assert torch.equal(_logits(trainer.ref_model, packed), ref_before)
        assert not torch.equal(_logits(trainer.model, packed), _logits(trainer.ref_model, packed))


def test_an_exception_inside_clears_the_replay(trainer, packed):
    with recording(trainer.model) as record:
        _logits(trainer.model, packed)
    with pytest.raises(RuntimeError, match="inside"):
        with replaying(trainer.model, record.experts()):
            assert all(r.router_replay.target_topk_idx is not None for r in routers(trainer.model))
            raise RuntimeError("inside")
    assert all(_untouched(r) for r in routers(trainer.model))


def test_shapes_and_ids_are_checked_in_one_line(trainer, packed):
    model, arch = trainer.model, trainer.arch
    tokens, layers, k = packed.input_ids.shape[1], arch.num_layers, arch.moe_router_topk
    good = torch.arange(k).expand(tokens, layers, k)
    cases = [
        (good[:, :1], r"experts has shape \(\d+, 1, 2\), expected \[tokens, 2 MoE layers, top_k=2\]"),
        (good[..., :1], r"experts has shape \(\d+, 2, 1\), expected \[tokens, 2 MoE layers, top_k=2\]"),
        (good.float(), "experts has dtype torch.float32, expected an integer dtype"),
        (good + arch.num_experts - 1, f"expert ids span \\[{arch.num_experts - 1}, {arch.num_experts}\\]"),
        (torch.zeros_like(good), "names the same expert twice"),
    ]
    for experts, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            with replaying(model, experts):
                pass
        assert "\n" not in str(err.value)
    # the token count is known at the forward: a router refuses a micro-batch of another length
    with pytest.raises(ValueError, match=f"layer 1 routes {tokens} tokens, experts has {tokens - 1} rows"):
        with replaying(model, good[1:]):
            _logits(model, packed)
    assert all(_untouched(r) for r in routers(model))


def _plain_model(ckpt):
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config

    arch = architecture_from_hf(read_hf_config(ckpt))
    model = build_gpt_model(arch, tp_size=1, routing_replay=True)
    load_hf_into_model(model, ckpt, arch, tp=1, rank=0)
    return model, arch


def _hand_routing(experts: torch.Tensor, num_experts: int):
    """The router's routing with given experts, written from the formula: softmax over the k logits."""

    def routing(logits, padding_mask=None):
        z = logits.reshape(-1, num_experts)
        p = z.gather(1, experts).softmax(-1)
        probs = torch.zeros_like(z).scatter(1, experts, p)
        routing_map = torch.zeros_like(z, dtype=torch.bool).scatter(1, experts, True)
        return probs, routing_map

    return routing


def test_router_gradient_under_replay_is_the_hand_computed_one(single_rank, cache_dir, packed):
    ckpt = tiny_moe_checkpoint(cache_dir)
    model, arch = _plain_model(ckpt)
    assert arch.norm_topk_prob
    params = dict(model.named_parameters())
    with recording(model) as record:
        logits = _logits(model, packed)
    replayed = (record.experts() + 1) % arch.num_experts
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))

    def gradients():
        loss = (forward_packed(model, packed) * weights).sum()
        return loss.detach(), dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))

    # the model's own choice replayed: the gradient of free routing, every parameter
    free_loss, free_grads = gradients()
    with replaying(model, record.experts()):
        own_loss, own_grads = gradients()
    assert torch.equal(own_loss, free_loss)
    for name, grad in free_grads.items():
        assert (grad is None and own_grads[name] is None) or torch.equal(grad, own_grads[name]), name

    with replaying(model, replayed):
        loss, grads = gradients()
    for layer, router in enumerate(routers(model)):  # the hand routing, outside Megatron's replay
        router.routing = _hand_routing(replayed[:, layer], arch.num_experts)
    try:
        hand_loss, hand_grads = gradients()
    finally:
        for router in routers(model):
            del router.routing

    router_names = [n for n in params if n.endswith("mlp.router.weight")]
    assert len(router_names) == arch.num_layers
    for name in router_names:  # the replayed experts' probabilities carry the router's gradient
        assert grads[name] is not None and grads[name].abs().max() > 0
    torch.testing.assert_close(loss, hand_loss, atol=0, rtol=1e-6)
    for name, grad in grads.items():
        if grad is None:
            assert hand_grads[name] is None, name
            continue
        torch.testing.assert_close(grad, hand_grads[name], atol=1e-7, rtol=1e-5, msg=name)


def _engine_rows(trainer, batch) -> list[bytes]:
    """Each sample's routing as an engine sends it: the trainer's own top-k of its tokens but the
    last, [tokens - 1, layers, top_k] uint8 (.npy bytes)."""
    out = []
    for tokens, response in zip(batch["tokens"], batch["response_length"]):
        packed_one = pack_samples([tokens], [response])
        with recording(trainer.model) as record:
            _logits(trainer.model, packed_one)
        out.append(routed_experts.encode(record.experts()[:-1].numpy().astype(np.uint8)))
    return out


def test_the_micro_batch_carries_the_engines_experts_in_packed_order(trainer):
    batch = hand_batch()
    batch["routed_experts"] = _engine_rows(trainer, batch)
    indices = [2, 0, 3]
    mb = make_micro_batch(batch, indices, "cpu", trainer.model)
    with recording(trainer.model) as record:
        _logits(trainer.model, mb.packed)
    own = record.experts()
    starts = mb.packed.cu_seqlens.tolist()
    k = trainer.arch.moe_router_topk
    for n, i in enumerate(indices):
        begin, end = starts[n], starts[n + 1]
        # every recorded row is the engine's (here the trainer's own routing of the sample alone)
        assert torch.equal(mb.experts[begin : end - 1], own[begin : end - 1])
        assert torch.equal(mb.experts[end - 1], torch.arange(k).expand(trainer.arch.num_layers, k))  # pad row
        assert mb.routing.recorded[begin : end - 1].all() and not mb.routing.recorded[end - 1]
    lps = forward_log_probs(trainer.model, batch, [indices], trainer.arch.vocab_size, 1.0, "cpu")
    replayed = forward_log_probs(trainer.model, batch, [indices], trainer.arch.vocab_size, 1.0, "cpu", replay=True)
    for i in indices:  # its own routing replayed: the same log-probs
        torch.testing.assert_close(replayed[i], lps[i], atol=1e-6, rtol=0)


def test_other_experts_change_the_log_probs_and_missing_rows_are_refused(trainer):
    batch = hand_batch()
    rows = [routed_experts.decode(b) for b in _engine_rows(trainer, batch)]
    num_experts = trainer.arch.num_experts
    batch["routed_experts"] = [routed_experts.encode((r + 1) % num_experts) for r in rows]
    vocab = trainer.arch.vocab_size
    free = forward_log_probs(trainer.model, batch, [[0, 1]], vocab, 1.0, "cpu")
    other = forward_log_probs(trainer.model, batch, [[0, 1]], vocab, 1.0, "cpu", replay=True)
    assert max(float((other[i] - free[i]).abs().max()) for i in (0, 1)) > 1e-3

    short = dict(batch, routed_experts=[routed_experts.encode(rows[0][:2]), *batch["routed_experts"][1:]])
    needed = len(batch["tokens"][0]) - 1  # the last trained token's position
    with pytest.raises(ValueError, match=f"sample 0 has routed_experts for 2 tokens, its trained tokens need {needed}"):
        make_micro_batch(short, [0], "cpu", trainer.model)
    untrained = dict(short, loss_mask=[[0] * r for r in batch["response_length"]])
    make_micro_batch(untrained, [0], "cpu", trainer.model)  # no trained token: no row needed
    with pytest.raises(ValueError, match="sample 1 has no routed_experts") as err:
        make_micro_batch(dict(batch, routed_experts=[None] * 4), [1], "cpu", trainer.model)
    assert "\n" not in str(err.value)
    wide = [routed_experts.encode(np.zeros((5, 1, 2), np.uint8))] * 4
    with pytest.raises(ValueError, match="routed_experts have 1 layers x top_2, the model routes layers 0..1"):
        make_micro_batch(dict(batch, routed_experts=wide), [0], "cpu", trainer.model)


def test_training_with_replay_runs_and_reports_the_mismatch(trainer):
    batch = hand_batch()
    batch["routed_experts"] = _engine_rows(trainer, batch)
    step_samples, trainer.cfg.global_batch_size = trainer.cfg.global_batch_size, len(batch["tokens"])
    try:  # one optimizer step: its forward routes with the weights the engine's rows came from
        metrics = trainer.train(0, batch)
    finally:
        trainer.cfg.global_batch_size = step_samples
    assert np.isfinite(metrics["loss"]) and "train_rollout_logprob_abs_diff" in metrics
    assert metrics[EXPERT_AGREEMENT] == 1.0  # the engine's rows are the trainer's own routing
    assert all(_untouched(r) for r in routers(trainer.model) + routers(trainer.ref_model))


def test_expert_agreement_counts_the_routers_own_choice_against_the_replayed(trainer, packed):
    """ExpertAgreement: own routing replayed agrees everywhere; with only the last layer's experts
    rotated, the layers before agree and the last one agrees where the rotation kept an expert
    (its input is the free run's, so its own choice is the recorded one). Rows the engine did not
    record are not counted, and a second forward (activation recompute) adds nothing."""
    model, num_experts = trainer.model, trainer.arch.num_experts
    with recording(model) as record:
        _logits(model, packed)
    own = record.experts()
    rows, layers, k = own.shape
    recorded = torch.ones(rows, dtype=torch.bool)
    recorded[-3:] = False
    counted = int(recorded.sum())

    agreement = ExpertAgreement(recorded, counted)
    with replaying(model, own, agreement):
        _logits(model, packed)
        _logits(model, packed)
    assert agreement.slots == counted * layers * k
    assert int(agreement.matched) == agreement.slots

    replayed = own.clone()
    replayed[:, -1] = (own[:, -1] + 1) % num_experts
    kept = (own[:, -1].unsqueeze(-1) == replayed[:, -1].unsqueeze(-2)).any(-1)[recorded].sum()
    agreement = ExpertAgreement(recorded, counted)
    with replaying(model, replayed, agreement):
        _logits(model, packed)
    assert int(agreement.matched) == counted * (layers - 1) * k + int(kept) < agreement.slots
    assert all(_untouched(r) for r in routers(model))
    assert "get_replay_topk" not in routers(model)[0].router_replay.__dict__
