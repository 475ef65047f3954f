"""Worker process of the expert-parallel MoE trainer tests (spawned by dist_workers.spawn), and what
its reference run on one rank records the same way."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Iterable

import torch

from tests.integration.trainer.hand_batch import hand_batch
from tests.integration.trainer.router_loss_workers import router_loss_config


def ep_config(checkpoint: str, storage: str, tp: int = 1, ep: int = 1, world_size: int = 1, **overrides):
    """The router-loss tests' config (aux loss on) at (TP=tp, DP=world_size/tp, EP=ep)."""
    return router_loss_config(checkpoint, storage, tp, world_size, expert_model_parallel_size=ep, **overrides)


def probe_ids(vocab_size: int, index: int) -> torch.Tensor:
    """Sequence ``index`` of the logits probe: each rank's has its own tokens and length, so the
    EP ranks' micro-batches hold different numbers of tokens (compat_moe.PaddedAllGatherDispatcher)."""
    gen = torch.Generator().manual_seed(11 + index)
    return torch.randint(0, vocab_size, (1, 9 + 4 * index), generator=gen)


def logits(model: Any, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The model's logits of ``ids`` (one causal sequence), its vocabulary-parallel parts gathered
    over TP and the padding cut."""
    from megatron.core import parallel_state

    seq = ids.shape[1]
    causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
    with torch.no_grad():
        part = model(ids, torch.arange(seq)[None], causal)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(part) for _ in range(tp)]
        torch.distributed.all_gather(parts, part, group=parallel_state.get_tensor_model_parallel_group())
        part = torch.cat(parts, dim=-1)
    return part[..., :vocab_size].clone()


def published_stream(trainer: Any) -> list[tuple[str, torch.Tensor]]:
    """What ``trainer.publish`` hands the transports on rank 0 (names and tensors, in order); the
    engines are left out: the stream is replaced by a list at the trainer's call of publish_weights."""
    import vime_core.trainer.trainer as trainer_module

    stream: list[tuple[str, torch.Tensor]] = []

    def record(weights, *args, **kwargs):
        stream.extend((name, tensor.clone()) for name, tensor in weights)
        return {"recorded": len(stream)}

    saved = trainer_module.publish_weights, trainer_module.PublishLoop
    trainer_module.publish_weights, trainer_module.PublishLoop = record, lambda **kwargs: None
    try:
        trainer.publish(["http://127.0.0.1:9"])
    finally:
        trainer_module.publish_weights, trainer_module.PublishLoop = saved
    return stream


def run_and_record(trainer: Any, checkpoint: str, probe: Iterable[int]) -> dict[str, Any]:
    """Round trip, the logits of the ``probe`` sequences, the publish stream, one rollout and the
    weights and log-probs after it."""
    from vime_core.trainer.hf_convert import read_hf_safetensors, unwrap

    source = read_hf_safetensors(checkpoint)
    gathered = list(trainer.iter_hf_weights())  # whole: a short-circuit would desync the gathers
    bare, vocab = unwrap(trainer.model), trainer.arch.vocab_size
    result: dict[str, Any] = {
        "round_trip_names": [n for n, _ in gathered],
        "round_trip_exact": sorted(n for n, _ in gathered) == sorted(source)
        and all(torch.equal(t, source[n]) for n, t in gathered),
        "logits": {i: logits(bare, probe_ids(vocab, i), vocab) for i in probe},
        "stream": published_stream(trainer),
    }
    metrics = trainer.train(0, hand_batch())
    result.update(
        metrics=metrics,
        hf={n: t.clone() for n, t in trainer.iter_hf_weights()},
        local={n: p.detach().clone() for n, p in bare.named_parameters()},
        log_probs=trainer.compute_log_probs(hand_batch()),
    )
    return result


def train_ep_and_dump(
    rank: int,
    world_size: int,
    port: int,
    tp: int,
    ep: int,
    checkpoint: str,
    storage: str,
    out: str,
    steps: int,
    distributed_optimizer: bool = False,
) -> None:
    """This rank of a (TP=tp, DP=world/tp, EP=ep) trainer: ``run_and_record`` of its probe sequence
    (its DP rank's), plus its EP rank as Megatron's parallel state has it. `distributed_optimizer`:
    Megatron's DistributedOptimizer, set past the configuration's device=cuda check (the CPU shim
    of compat_cpu runs it: its GPU code paths under test)."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from megatron.core import parallel_state

    from vime_core.trainer.parallel import destroy_parallel
    from vime_core.trainer.trainer import MegatronTrainer

    cfg = ep_config(checkpoint, storage, tp, ep, world_size, num_steps_per_rollout=steps)
    cfg.use_distributed_optimizer = distributed_optimizer
    trainer = MegatronTrainer(cfg, rank, world_size, "127.0.0.1", port)
    trainer.init()
    before_first_step = trainer.save(99)  # a folder of its own: Adam holds no state yet
    result = run_and_record(trainer, checkpoint, [trainer.layout.dp_rank])
    # a checkpoint brings back this rank's experts after another rollout moved them, and its
    # optimizer state (Adam's moments, the step count): the rollout trained again moves them as before
    saved = trainer.save(0)
    trainer.train(1, hand_batch())
    moved = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    trainer.load(saved)
    restored = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    trainer.train(1, hand_batch())
    again = {n: p.detach() for n, p in trainer.model.module.named_parameters()}
    result["checkpoint_restores"] = all(torch.equal(restored[n], result["local"][n]) for n in restored)
    result["rollout_moved_experts"] = any(
        not torch.equal(moved[n], result["local"][n]) for n in moved if ".local_experts." in n
    )
    result["resume_retrains_alike"] = all(torch.equal(again[n], moved[n]) for n in moved)
    # and one written before the first optimizer step brings back the start: the first rollout again
    trainer.load(before_first_step)
    trainer.train(0, hand_batch())
    first = {n: p.detach() for n, p in trainer.model.module.named_parameters()}
    result["fresh_checkpoint_retrains_alike"] = all(torch.equal(first[n], result["local"][n]) for n in first)
    result["distributed_optimizer"] = type(trainer.optimizer.chained_optimizers[-1]).__name__
    result["layout"] = trainer.layout
    result["megatron_ep_rank"] = parallel_state.get_expert_model_parallel_rank()
    torch.save(result, Path(out) / f"rank{rank}.pt")
    destroy_parallel()
