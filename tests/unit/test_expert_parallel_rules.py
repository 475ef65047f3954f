"""Expert parallelism without a process group: which rank holds which expert (Megatron's layout),
the conversion rules' EP owners and local names, an in-memory HF -> (TP x EP shards) -> HF round
trip, and the one-line refusals naming --expert-model-parallel-size."""

from __future__ import annotations

import pytest
import torch

from tests.moe_tiny import random_hf_tensors, tiny_mixtral_config, tiny_moe_config
from vime_core.trainer.hf_convert import conversion_rules, held_by, hf_to_megatron_shard, shards_to_hf
from vime_core.trainer.model import architecture_from_hf, check_ep_divides, moe_settings
from vime_core.trainer.parallel import layout_for


def test_layout_puts_ep_inside_the_data_parallel_ranks():
    """8 ranks, TP=2, EP=2: Megatron's expert order tp-ep-dp, so the EP peers of rank r are r and r + TP."""
    layouts = [layout_for(r, 8, 2, 2) for r in range(8)]
    assert [lay.ep_rank for lay in layouts] == [0, 0, 1, 1, 0, 0, 1, 1]
    # one whole copy of the weights: DP replica 0's TP group and its EP peers
    assert [r for r, lay in enumerate(layouts) if lay.holds_first_copy] == [0, 1, 2, 3]
    assert [r for r in range(8) if layout_for(r, 8, 2).holds_first_copy] == [0, 1]
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 does not divide the data-parallel size 4"):
        layout_for(0, 8, 2, 3)


@pytest.mark.parametrize("config", [tiny_moe_config, tiny_mixtral_config])
def test_rules_give_each_ep_rank_its_block_of_experts(config):
    arch = architecture_from_hf(config())
    rules = conversion_rules(arch, ep=2)
    assert [n for r in rules for n in r.hf] == [n for r in conversion_rules(arch) for n in r.hf]  # HF order kept
    experts = [r for r in rules if r.expert_owner is not None]
    assert len(experts) == arch.num_layers * arch.num_experts * 2  # fc1, fc2 of each expert of each layer
    for rule in experts:
        global_id = int(rule.hf[0].split(".experts.")[1].split(".")[0])
        local_id = int(rule.megatron.split("local_experts.")[1].split(".")[0])
        assert (rule.expert_owner, local_id) == divmod(global_id, arch.num_experts // 2)
    held = [{r.megatron for r in rules if held_by(r, p)} for p in (0, 1)]
    assert held[0] == held[1]  # the same local names on both EP ranks, other experts behind them
    assert len(held[0]) == len(conversion_rules(arch)) - arch.num_layers * arch.num_experts  # half the experts


@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 4)])
def test_expert_shards_over_tp_and_ep_gather_back_exactly(tp, ep):
    arch = architecture_from_hf(tiny_moe_config())
    hf = random_hf_tensors(arch, (n for r in conversion_rules(arch) for n in r.hf))
    shards = {(t, p): hf_to_megatron_shard(hf, arch, tp, t, ep=ep, ep_rank=p) for t in range(tp) for p in range(ep)}
    local = arch.num_experts // ep
    fc1 = shards[(0, ep - 1)]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    f = arch.moe_ffn_hidden_size
    assert torch.equal(fc1[: f // tp], hf[f"model.layers.0.mlp.experts.{(ep - 1) * local}.gate_proj.weight"][: f // tp])
    for rule in conversion_rules(arch, ep):
        owner = rule.expert_owner or 0
        parts = [shards[(t, owner)][rule.megatron] for t in range(tp)]
        for name, tensor in zip(rule.hf, shards_to_hf(rule, lambda t, dim, ps=parts: ps, parts[0], arch, tp)):
            assert torch.equal(tensor, hf[name]), name


def test_ep_must_divide_the_experts_of_an_moe_model():
    arch = architecture_from_hf(tiny_moe_config())
    check_ep_divides(arch, 4)
    assert moe_settings(arch, 2, ep_size=4)["expert_model_parallel_size"] == 4
    assert moe_settings(arch, 2, ep_size=4)["expert_tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="expert_model_parallel_size=3 does not divide the model's num_experts=8"):
        check_ep_divides(arch, 3)
    dense = architecture_from_hf(tiny_moe_config() | {"model_type": "qwen3"})
    check_ep_divides(dense, 1)
    with pytest.raises(ValueError, match="expert_model_parallel_size=2: the model .* has no experts") as e:
        check_ep_divides(dense, 2)
    assert "\n" not in str(e.value)


def test_a_checkpoint_loads_only_at_the_expert_parallel_size_it_was_written_with(tmp_path):
    """Each rank's file holds its own experts: another EP size is refused in one line, a manifest
    without `ep` (written before expert parallelism) counts as EP=1."""
    from vime_core.trainer import checkpoint as ckpt

    manifest = {"rollout_id": 0, "world_size": 2, "tp": 1, "dp": 2, "files": ["rank_0.pt", "rank_1.pt"]}
    for ep, folder in ((2, "ep2"), (None, "old")):
        path = str(tmp_path / folder)
        ckpt.save_rank_state(path, 0, {"model": {"w": torch.ones(2)}})
        ckpt.write_manifest(path, manifest | ({"ep": ep} if ep else {}))
    assert torch.equal(ckpt.load_rank_state(str(tmp_path / "ep2"), 0, 2, 1, ep_size=2)["model"]["w"], torch.ones(2))
    assert torch.equal(ckpt.load_rank_state(str(tmp_path / "old"), 0, 2, 1)["model"]["w"], torch.ones(2))
    with pytest.raises(ckpt.CheckpointError, match=r"written with world_size=2, tp=1, ep=2; .* ep=1 \(resharding") as e:
        ckpt.load_rank_state(str(tmp_path / "ep2"), 0, 2, 1)
    assert "\n" not in str(e.value)
    with pytest.raises(ckpt.CheckpointError, match="ep=1; this trainer has world_size=2, tp=1, ep=2"):
        ckpt.load_rank_state(str(tmp_path / "old"), 0, 2, 1, ep_size=2)
