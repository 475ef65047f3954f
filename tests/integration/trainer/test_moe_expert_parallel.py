"""Expert parallelism (EP=2: the 8 experts of each MoE layer split over two data-parallel ranks,
4 each) against one rank holding all experts, over gloo in subprocesses: the HF round trip is exact,
each rank holds experts ep_rank * 4 .. ep_rank * 4 + 3, the logits, the loss with the router's
aux loss, the gradient norm, the weights after a rollout and the log-probs
are those of EP=1, a publish streams every expert once, as EP=1 does, and a checkpoint restores
each rank's experts."""

from __future__ import annotations

import pytest
import torch

from tests.integration.trainer.dist_workers import spawn
from tests.integration.trainer.ep_workers import ep_config, run_and_record, train_ep_and_dump
from tests.integration.trainer.test_distributed import ATOL, WEIGHT_ATOL
from tests.moe_tiny import tiny_mixtral_checkpoint, tiny_moe_checkpoint

LOGITS_ATOL = 1e-5  # fp32 on CPU, as test_moe.py
CHECKPOINTS = {"qwen3_moe": tiny_moe_checkpoint, "mixtral": tiny_mixtral_checkpoint}
EXPERT_FC2 = {"qwen3_moe": "mlp.experts.{e}.down_proj.weight", "mixtral": "block_sparse_moe.experts.{e}.w2.weight"}


@pytest.fixture(scope="module", params=[("qwen3_moe", 2), ("mixtral", 2)], ids=lambda p: p[0])
def reference(request, single_rank, cache_dir, tmp_path_factory):
    """The EP=1 run on one rank in this process (family, optimizer steps per rollout), recorded as the
    workers record theirs, with the probe sequences of four DP ranks."""
    from vime_core.trainer.trainer import MegatronTrainer

    family, steps = request.param
    ckpt = CHECKPOINTS[family](cache_dir)
    cfg = ep_config(str(ckpt), str(tmp_path_factory.mktemp("ref")), num_steps_per_rollout=steps)
    trainer = MegatronTrainer(cfg, 0, 1, "127.0.0.1", 0)
    trainer.init()
    return {"family": family, "steps": steps, "ckpt": ckpt, **run_and_record(trainer, str(ckpt), range(4))}


def _check_against_reference(got: dict, ref: dict, probe: int) -> None:
    assert got["round_trip_exact"] and got["round_trip_names"] == ref["round_trip_names"]
    torch.testing.assert_close(got["logits"][probe], ref["logits"][probe], atol=LOGITS_ATOL, rtol=0)
    ours, theirs = got["metrics"], ref["metrics"]
    assert ours["loss"] == pytest.approx(theirs["loss"], abs=ATOL)
    assert ours["moe_aux_loss"] == pytest.approx(theirs["moe_aux_loss"], rel=1e-5) and theirs["moe_aux_loss"] > 0
    assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
    assert sorted(got["hf"]) == sorted(ref["hf"])
    for name, tensor in ref["hf"].items():
        torch.testing.assert_close(got["hf"][name], tensor, atol=WEIGHT_ATOL, rtol=0, msg=name)
    for a, b in zip(got["log_probs"], ref["log_probs"]):
        assert a == pytest.approx(b, abs=ATOL)


def _run_and_check(tmp_path, reference, tp: int, world: int, distributed_optimizer: bool = False) -> None:
    from vime_core.trainer.hf_convert import read_hf_safetensors

    ckpt = reference["ckpt"]
    storage, steps = str(tmp_path / "storage"), reference["steps"]
    spawn(train_ep_and_dump, world, tp, 2, str(ckpt), storage, str(tmp_path), steps, distributed_optimizer)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    source = read_hf_safetensors(ckpt)
    changed = [n for n in source if not torch.equal(reference["hf"][n], source[n])]
    assert any(".experts.5." in n for n in changed)  # the step moved experts of EP rank 1
    for got in ranks:
        lay = got["layout"]
        assert lay.ep_rank == got["megatron_ep_rank"] == lay.dp_rank % 2
        _check_against_reference(got, reference, lay.dp_rank)
        assert got["rollout_moved_experts"] and got["checkpoint_restores"] and got["resume_retrains_alike"]
        assert got["fresh_checkpoint_retrains_alike"]
        assert got["distributed_optimizer"] == ("DistributedOptimizer" if distributed_optimizer else "FP32Optimizer")
        # this rank holds local experts 0..3, global experts 4 * ep_rank .. 4 * ep_rank + 3 (its TP slice)
        local = [n for n in got["local"] if ".experts.local_experts." in n and n.startswith("decoder.layers.1.")]
        assert sorted({n.split("local_experts.")[1].split(".")[0] for n in local}) == ["0", "1", "2", "3"]
        fc2 = got["local"]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"]
        full = got["hf"]["model.layers.1." + EXPERT_FC2[reference["family"]].format(e=4 * lay.ep_rank + 1)]
        torch.testing.assert_close(fc2, full.chunk(tp, dim=1)[lay.tp_rank], atol=0, rtol=0)
    # rank 0 published every HF tensor once, in EP=1's order and with EP=1's values; the other
    # ranks took part in the gathers and sent nothing
    stream, ref_stream = ranks[0]["stream"], reference["stream"]
    assert [n for n, _ in stream] == [n for n, _ in ref_stream] == list(dict(ref_stream))
    for (name, tensor), (_, expected) in zip(stream, ref_stream):
        assert torch.equal(tensor, expected), name
    assert all(got["stream"] == [] for got in ranks[1:])


@pytest.mark.slow
def test_ep2_trains_and_publishes_as_ep1(tmp_path, reference):
    """EP=2 x DP=2 on two ranks, each family."""
    _run_and_check(tmp_path, reference, tp=1, world=2)


@pytest.mark.slow
@pytest.mark.parametrize("reference", [("qwen3_moe", 2)], indirect=True, ids=["qwen3_moe"])
def test_ep2_with_tp2_on_four_ranks(tmp_path, reference):
    """TP=2 x EP=2 x DP=2: each expert also split over TP (expert TP = TP), the TP ranks routing
    the whole sequence (compat_moe.allow_full_sequence_tp)."""
    _run_and_check(tmp_path, reference, tp=2, world=4)


@pytest.mark.slow
@pytest.mark.parametrize("reference", [("qwen3_moe", 1)], indirect=True, ids=["qwen3_moe-one-step"])
def test_ep2_with_two_expert_data_parallel_replicas(tmp_path, reference):
    """EP=2 x DP=4 (4 ranks, one sample each in a one-step rollout) under the distributed optimizer:
    two copies of each expert, whose gradients Megatron's DDP reduce-scatters over the expert-DP
    group (ranks 0, 2 and 1, 3), scaled by 1/DP, each rank then holding the Adam state of half of its
    experts (the dense parameters': a quarter), all-gathered back after the step; the gradient norm
    sums every shard once; ranks 2 and 3 hold no part of the first copy and stay out of the publish;
    a checkpoint restores each rank's shards (the rollout after it trains again to the same weights)."""
    _run_and_check(tmp_path, reference, tp=1, world=4, distributed_optimizer=True)
