"""LoRA helpers of the trainer tests and their TP=2 workers: seeded whole adapters loaded into any
TP layout, and one forward/backward whose log-probs and whole (TP-gathered) gradients are compared."""

from __future__ import annotations

from pathlib import Path

import torch

PEFT_PREFIX = "base_model.model.model.layers."


def seeded_adapters(arch, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """Whole adapter tensors under PEFT names, non-zero B, a fused layer's A shared by its projections."""
    from vime_core.config.lora import MEGATRON_LAYERS

    gen = torch.Generator().manual_seed(seed)
    shapes = {
        "self_attn.q_proj": (arch.num_heads * arch.head_dim, arch.hidden_size),
        "self_attn.k_proj": (arch.num_kv_heads * arch.head_dim, arch.hidden_size),
        "self_attn.v_proj": (arch.num_kv_heads * arch.head_dim, arch.hidden_size),
        "self_attn.o_proj": (arch.hidden_size, arch.num_heads * arch.head_dim),
        "mlp.gate_proj": (arch.ffn_hidden_size, arch.hidden_size),
        "mlp.up_proj": (arch.ffn_hidden_size, arch.hidden_size),
        "mlp.down_proj": (arch.hidden_size, arch.ffn_hidden_size),
    }
    state = {}
    for i in range(arch.num_layers):
        for group in MEGATRON_LAYERS.values():
            a = torch.randn(rank, shapes[group[0]][1], generator=gen) * 0.1
            for proj in group:
                state[f"{PEFT_PREFIX}{i}.{proj}.lora_A.weight"] = a
                b = torch.randn(shapes[proj][0], rank, generator=gen) * 0.1
                state[f"{PEFT_PREFIX}{i}.{proj}.lora_B.weight"] = b
    return state


def load_adapters(trainer, state: dict[str, torch.Tensor]) -> None:
    from vime_core.config.lora import MEGATRON_LAYERS
    from vime_core.trainer.lora import adapted_layers, load_full_adapter

    lay = trainer.layout
    for i, name, module in adapted_layers(trainer.model):
        projs = MEGATRON_LAYERS[name]
        a = state[f"{PEFT_PREFIX}{i}.{projs[0]}.lora_A.weight"]
        b = [state[f"{PEFT_PREFIX}{i}.{p}.lora_B.weight"] for p in projs]
        load_full_adapter(module, name, trainer.arch, lay.tp_size, lay.tp_rank, a, b)


def forward_backward(trainer, batch) -> dict:
    """Response log-probs (with grad) of every sample, loss = sum of log-probs times fixed weights,
    backward; returns the log-probs and the whole adapter gradients under PEFT names."""
    from vime_core.trainer.logprobs import packed_response_log_probs
    from vime_core.trainer.lora import adapted_layers, lora_hf_state
    from vime_core.trainer.train_step import make_micro_batch

    trainer.model.zero_grad_buffer()
    mb = make_micro_batch(batch, list(range(len(batch["tokens"]))), trainer.device)
    lp, _ = packed_response_log_probs(trainer.model, mb.packed, trainer.arch.vocab_size, 1.0)
    weights = torch.linspace(-1.0, 1.0, lp.numel()).reshape(lp.shape)
    (lp * weights).sum().backward()
    layers = [m.lora for _, _, m in adapted_layers(trainer.model)]
    saved = [(a.A.data.clone(), a.B.data.clone()) for a in layers]
    for a in layers:  # the gradients in the parameters' place, gathered as the parameters are
        a.A.data.copy_(a.A.main_grad)
        a.B.data.copy_(a.B.main_grad)
    grads = lora_hf_state(trainer.model, trainer.arch)
    for a, (A, B) in zip(layers, saved):
        a.A.data.copy_(A)
        a.B.data.copy_(B)
    trainer.model.zero_grad_buffer()
    return {"log_probs": lp.detach().clone(), "grads": grads}


def train_adapters(trainer) -> dict:
    """Two optimizer steps of the hand batch: loss, grad norm, the whole adapters afterwards."""
    from tests.integration.trainer.hand_batch import hand_batch
    from vime_core.trainer.lora import lora_hf_state

    metrics = trainer.train(0, hand_batch())
    peft = lora_hf_state(trainer.model, trainer.arch)
    return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "peft": peft}


def lora_config(checkpoint, storage, **overrides):
    from tests.integration.trainer.hand_batch import hand_config

    return hand_config(Path(checkpoint), Path(storage), **{"lora_rank": 4, "lora_alpha": 8.0, **overrides})


def tp_forward_backward(rank: int, world_size: int, port: int, checkpoint: str, storage: str, out: str) -> None:
    """Worker of dist_workers.spawn at TP=world_size: the seeded adapters' forward_backward,
    the merged HF weights and the PEFT state, dumped by each rank."""
    import warnings

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from tests.integration.trainer.hand_batch import hand_batch
    from vime_core.trainer.lora import lora_hf_state
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = lora_config(
        checkpoint,
        storage,
        tensor_model_parallel_size=world_size,
        actor_num_gpus_per_node=world_size,
        colocate=False,
        rollout_num_gpus=1,
    )
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    initial = lora_hf_state(trainer.model, trainer.arch)  # seed-derived A, zero B
    load_adapters(trainer, seeded_adapters(trainer.arch, cfg.lora_rank, seed=3))
    result = forward_backward(trainer, hand_batch())
    result["initial"] = initial
    result["hf"] = {n: t.clone() for n, t in trainer.iter_hf_weights()}
    result["peft"] = lora_hf_state(trainer.model, trainer.arch)
    result["trained"] = train_adapters(trainer)
    torch.save(result, Path(out) / f"rank{rank}.pt")


def recompute_train(rank: int, world_size: int, port: int, checkpoint: str, storage: str, recompute: str, out: str):
    """Worker of dist_workers.spawn on CUDA (its own NCCL process group: the session's single_rank is
    gloo, which cannot reduce CUDA gradients): one rollout's two optimizer steps with LoRA and
    recompute_granularity=`recompute` ("" for none); the parameters before and after, which ones
    train, the loss and the optimizer's step count, saved to `out`."""
    from tests.integration.trainer.hand_batch import hand_batch
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = lora_config(checkpoint, storage, device="cuda", bf16=True, recompute_granularity=recompute or None)
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    before = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
    metrics = trainer.train(0, hand_batch())
    torch.save(
        {
            "before": before,
            "after": {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()},
            "trainable": [n for n, p in trainer.model.named_parameters() if p.requires_grad],
            "loss": metrics["loss"],
            "optimizer_steps": trainer.optimizer_steps,
        },
        out,
    )
