"""The MoE router's losses through the real trainer (TP=1, CPU): the load-balancing and z losses
enter the policy's gradient exactly as their formulas say, weighted like the policy loss, and their
values reach the step's metrics. The expected gradients and values come from the Megatron model's
router inputs, with the losses written out here from their definitions:

    lb_l(B) = E * sum_i f_i * P_i,  f_i = #(tokens routing to i) / (T * k),  P_i = mean_x softmax(z_x)_i
    z_l(B)  = mean_x logsumexp(z_x)^2,  z_x = h_x W_l^T (layer l's router logits)

and the step adds sum_m share_m * sum_l (moe_aux_loss_coeff * lb_l + moe_z_loss_coeff * z_l)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.integration.trainer.hand_batch import hand_batch, hand_config, single_rank_trainer
from tests.moe_tiny import tiny_moe_checkpoint
from vime_core.report.records import append_record, read_records
from vime_core.step_plan import Phase, iteration_record, plan_step

COEFF = 0.5  # large enough that the router term stands well above the fp32 noise of the policy gradient


def _trained(ckpt, tmp_path, name, **router_flags):
    """A trainer after one optimizer step on the hand batch (all four samples, one per micro-batch,
    no clipping: main_grad keeps the step's gradient), and the step's metrics."""
    cfg = hand_config(
        ckpt,
        tmp_path / name,
        num_steps_per_rollout=1,
        micro_batch_size=1,
        use_dynamic_batch_size=False,
        clip_grad=0.0,
        **router_flags,
    )
    trainer = single_rank_trainer(cfg)
    metrics = trainer.train(0, hand_batch())
    grads = {n: p.main_grad.detach().clone() for n, p in trainer.model.module.named_parameters()}
    return cfg, metrics, grads


def _router_inputs(model):
    """Forward pre-hooks that keep each MoE layer's router input (with its graph) and the router."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    seen: list = []
    routers = [m.router for m in model.modules() if isinstance(m, MoELayer)]
    for router in routers:
        router.register_forward_pre_hook(lambda mod, args, seen=seen: seen.append((mod, args[0])))
    return seen, len(routers)


def _expected(ckpt, batch, aux_coeff, z_coeff):
    """(gradient by parameter name, mean-over-layers lb and z weighted over the micro-batches) of the
    router terms alone, from a fresh model with the checkpoint's weights (the step's weights)."""
    from vime_core.trainer.hf_convert import load_hf_into_model
    from vime_core.trainer.logprobs import packed_response_log_probs
    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config
    from vime_core.trainer.packing import pack_samples

    arch = architecture_from_hf(read_hf_config(ckpt))
    model = build_gpt_model(arch, tp_size=1)
    load_hf_into_model(model, ckpt, arch, tp=1, rank=0)
    model.eval()  # the same forward; Megatron's router then adds no loss of its own
    seen, layers = _router_inputs(model)
    counts = [sum(m) for m in batch["loss_mask"]]
    shares = [c / sum(counts) for c in counts]  # token_mean: d(B_m) / D(S)
    total = 0.0
    lb_mean = z_mean = 0.0
    k, experts = arch.moe_router_topk, arch.num_experts
    for tokens, response, share in zip(batch["tokens"], batch["response_length"], shares):
        seen.clear()
        packed_response_log_probs(model, pack_samples([tokens], [response]), arch.vocab_size)
        assert len(seen) == layers
        for router, hidden in seen:
            logits = hidden.reshape(-1, hidden.shape[-1]).float() @ router.weight.float().t()
            probs = logits.softmax(-1)
            routed = torch.zeros_like(probs).scatter(1, probs.topk(k, dim=-1).indices, 1.0)
            n = logits.shape[0]
            lb = experts * ((routed.sum(0) / (n * k)) * probs.mean(0)).sum()
            z = logits.logsumexp(-1).square().mean()
            total = total + share * (aux_coeff * lb + z_coeff * z)
            lb_mean += share * lb.item() / layers
            z_mean += share * z.item() / layers
    total.backward()
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    return grads, lb_mean, z_mean


@pytest.mark.parametrize(
    "flags",
    [
        {"moe_aux_loss_coeff": COEFF},
        # Megatron's per-sequence loss: a packed micro-batch is one sequence, so the same formula
        {"moe_aux_loss_coeff": COEFF, "moe_router_load_balancing_type": "seq_aux_loss"},
        {"moe_z_loss_coeff": COEFF},
    ],
    ids=["aux", "seq_aux", "z"],
)
def test_router_losses_enter_the_gradient_and_the_metrics(single_rank, cache_dir, tmp_path, flags):
    ckpt = tiny_moe_checkpoint(cache_dir)
    base_cfg, base, base_grads = _trained(ckpt, tmp_path, "base")
    cfg, metrics, grads = _trained(ckpt, tmp_path, "router", **flags)
    assert base_cfg.loss_agg_mode == cfg.loss_agg_mode == "token_mean"
    aux, zc = cfg.moe_aux_loss_coeff, cfg.moe_z_loss_coeff
    expected, lb, z = _expected(ckpt, hand_batch(), aux, zc)

    # coefficient 0 logs nothing; the router losses leave the forward (the policy loss) as it was
    assert "moe_aux_loss" not in base and "moe_z_loss" not in base
    assert metrics["loss"] == base["loss"]
    name, value = ("moe_aux_loss", lb) if aux > 0 else ("moe_z_loss", z)
    assert math.isfinite(metrics[name]) and metrics[name] > 0
    assert metrics[name] == pytest.approx(value, rel=1e-5)

    routers = [n for n in grads if n.endswith("mlp.router.weight")]
    assert len(routers) == 2
    for n in routers:  # the router's gradient moved by the router term
        assert (grads[n] - base_grads[n]).abs().max() > 1e-3 * grads[n].abs().max()
    for n, g in grads.items():  # by exactly the router term, in every parameter the term reaches
        torch.testing.assert_close(g - base_grads[n], expected[n], atol=1e-6, rtol=1e-4, msg=n)

    # the metric reaches the iteration's record in metrics.jsonl like the trainer's other metrics
    record = iteration_record(plan_step(cfg, 0), {}, False, {Phase.TRAIN: metrics}, 1.0)
    append_record(cfg.storage_uri, cfg.run_name, record)
    assert read_records(cfg.storage_uri, cfg.run_name)[-1][name] == metrics[name]


@pytest.fixture(scope="module")
def aux_reference(single_rank, cache_dir, tmp_path_factory):
    """Two rollouts of the hand batch with the aux loss on one rank: metrics and HF weights."""
    from tests.integration.trainer.router_loss_workers import router_loss_config
    from vime_core.trainer.trainer import MegatronTrainer

    ckpt = tiny_moe_checkpoint(cache_dir)
    trainer = MegatronTrainer(router_loss_config(str(ckpt), str(tmp_path_factory.mktemp("aux"))), 0, 1, "127.0.0.1", 0)
    trainer.init()
    metrics = [trainer.train(k, hand_batch()) for k in range(2)]
    return {"ckpt": ckpt, "metrics": metrics, "hf": {n: t.clone() for n, t in trainer.iter_hf_weights()}}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_router_loss_is_the_same_on_two_ranks(tmp_path, aux_reference, tp):
    """DP=2: each rank's router term weighted by its micro-batches' share of the step; TP=2: each TP
    rank routes the whole sequence and still counts each token once (compat_moe)."""
    from tests.integration.trainer.dist_workers import spawn
    from tests.integration.trainer.router_loss_workers import train_with_aux_loss_and_dump
    from tests.integration.trainer.test_distributed import ATOL, WEIGHT_ATOL

    spawn(train_with_aux_loss_and_dump, 2, tp, str(aux_reference["ckpt"]), str(tmp_path / "storage"), str(tmp_path))
    ref = aux_reference["metrics"]
    assert all(m["moe_aux_loss"] > 0 for m in ref)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for ours, theirs in zip(got["metrics"], ref):
            assert ours["moe_aux_loss"] == pytest.approx(theirs["moe_aux_loss"], rel=1e-5)
            assert ours["loss"] == pytest.approx(theirs["loss"], abs=ATOL)
            assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
        for name, tensor in aux_reference["hf"].items():
            torch.testing.assert_close(got["hf"][name], tensor, atol=WEIGHT_ATOL, rtol=0, msg=name)
