"""Qwen3-MoE and Mixtral configs -> Megatron MoE architecture and its conversion rules, without a process group:
the names both ways (HF/vLLM names <-> Megatron's SequentialMLP names), the TP split of the
experts, and one-line refusals naming the field."""

from __future__ import annotations

import pytest
import torch

from tests.moe_tiny import random_hf_tensors, tiny_mixtral_config, tiny_moe_config
from vime_core.config import ConfigError, load_config, parse_args
from vime_core.trainer.hf_convert import conversion_rules, hf_to_megatron_shard, shards_to_hf
from vime_core.trainer.model import UnsupportedModelError, architecture_from_hf, check_tp_divides, moe_settings


def test_moe_rules_name_router_and_every_expert():
    arch = architecture_from_hf(tiny_moe_config())
    by_megatron = {r.megatron: r for r in conversion_rules(arch)}
    router = by_megatron["decoder.layers.1.mlp.router.weight"]
    assert (router.hf, router.kind) == (("model.layers.1.mlp.gate.weight",), "replicated")
    for e in range(arch.num_experts):
        fc1 = by_megatron[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"]
        fc2 = by_megatron[f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc2.weight"]
        h = f"model.layers.0.mlp.experts.{e}."
        assert (fc1.hf, fc1.kind) == ((h + "gate_proj.weight", h + "up_proj.weight"), "gate_up")
        assert (fc2.hf, fc2.kind) == ((h + "down_proj.weight",), "row")
    assert not any(".mlp.linear_fc1." in name for name in by_megatron)  # no dense MLP left
    hf_names = [n for r in conversion_rules(arch) for n in r.hf]
    per_layer = 4 + 2 + 1 + arch.num_experts * 3 + 2  # q k v o, q/k norms, gate, experts, 2 norms
    assert len(hf_names) == len(set(hf_names)) == 1 + arch.num_layers * per_layer + 1 + 1


def test_mixtral_rules_name_block_sparse_moe_and_w1_w3_w2():
    """save_pretrained's (and vLLM's) names: ``block_sparse_moe.gate`` and experts' w1 (gate), w3
    (up), w2 (down); Llama attention, so no q/k norms."""
    arch = architecture_from_hf(tiny_mixtral_config())
    by_megatron = {r.megatron: r for r in conversion_rules(arch)}
    router = by_megatron["decoder.layers.1.mlp.router.weight"]
    assert router.hf == ("model.layers.1.block_sparse_moe.gate.weight",)
    h = "model.layers.0.block_sparse_moe.experts.5."
    fc1 = by_megatron["decoder.layers.0.mlp.experts.local_experts.5.linear_fc1.weight"]
    fc2 = by_megatron["decoder.layers.0.mlp.experts.local_experts.5.linear_fc2.weight"]
    assert (fc1.hf, fc1.kind) == ((h + "w1.weight", h + "w3.weight"), "gate_up")
    assert (fc2.hf, fc2.kind) == ((h + "w2.weight",), "row")
    hf_names = [n for r in conversion_rules(arch) for n in r.hf]
    assert not any("norm" in n and "self_attn" in n for n in hf_names)
    per_layer = 4 + 1 + arch.num_experts * 3 + 2  # q k v o, gate, experts, 2 norms
    assert len(hf_names) == len(set(hf_names)) == 1 + arch.num_layers * per_layer + 1 + 1


def test_mixtral_experts_are_intermediate_size_and_always_renormalised():
    arch = architecture_from_hf(tiny_mixtral_config(intermediate_size=48))
    assert (arch.num_experts, arch.moe_router_topk, arch.moe_ffn_hidden_size) == (8, 2, 48)
    assert (arch.norm_topk_prob, arch.qk_norm, arch.qkv_bias) == (True, False, False)
    settings = moe_settings(arch, 1)
    assert settings["moe_router_pre_softmax"] is False and settings["moe_ffn_hidden_size"] == 48
    with pytest.raises(ValueError, match="the model's intermediate_size=33"):
        check_tp_divides(architecture_from_hf(tiny_mixtral_config(intermediate_size=33)), 2)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"num_local_experts": 0}, "num_experts=0"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_inexpressible_mixtral_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        architecture_from_hf(tiny_mixtral_config(**change))


def test_an_unknown_family_is_refused_naming_its_architecture():
    cfg = tiny_mixtral_config(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    with pytest.raises(UnsupportedModelError, match=r"\['DeepseekV3ForCausalLM'\].*is not supported") as info:
        architecture_from_hf(cfg)
    assert "\n" not in str(info.value) and "mixtral" in str(info.value)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_shards_gather_back_exactly(tp, family):
    arch = architecture_from_hf(tiny_mixtral_config() if family == "mixtral" else tiny_moe_config())
    f, h = arch.moe_ffn_hidden_size, arch.hidden_size
    hf = random_hf_tensors(arch, (n for r in conversion_rules(arch) for n in r.hf))
    shards = [hf_to_megatron_shard(hf, arch, tp, r) for r in range(tp)]
    fc1 = shards[-1]["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.shape == (2 * f // tp, h)  # [gate_r; up_r] of this rank
    gate = next(r for r in conversion_rules(arch) if r.megatron.endswith("local_experts.3.linear_fc1.weight")).hf[0]
    assert torch.equal(fc1[: f // tp], hf[gate][-(f // tp) :])
    for rule in conversion_rules(arch):
        locals_ = [s[rule.megatron] for s in shards]
        for name, tensor in zip(rule.hf, shards_to_hf(rule, lambda t, dim, ls=locals_: ls, locals_[0], arch, tp)):
            assert torch.equal(tensor, hf[name]), name


def test_moe_settings_follow_norm_topk_prob():
    normed = moe_settings(architecture_from_hf(tiny_moe_config(norm_topk_prob=True)), 2)
    raw = moe_settings(architecture_from_hf(tiny_moe_config(norm_topk_prob=False)), 2)
    assert normed["moe_router_pre_softmax"] is False and raw["moe_router_pre_softmax"] is True
    assert (normed["num_moe_experts"], normed["moe_router_topk"], normed["moe_ffn_hidden_size"]) == (8, 2, 32)
    assert (normed["expert_model_parallel_size"], normed["expert_tensor_parallel_size"]) == (1, 2)
    assert moe_settings(architecture_from_hf(tiny_moe_config() | {"model_type": "qwen3"}), 1) == {}


def test_num_local_experts_is_read_as_num_experts():
    cfg = tiny_moe_config()
    cfg["num_local_experts"] = cfg.pop("num_experts")  # how transformers 5 writes config.json
    assert architecture_from_hf(cfg).num_experts == 8


@pytest.mark.parametrize(
    "change,field",
    [
        ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
        ({"mlp_only_layers": [0]}, "mlp_only_layers"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9"),
        ({"num_experts": 0}, "num_experts=0"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_inexpressible_moe_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        architecture_from_hf(tiny_moe_config(**change))


def test_tp_must_divide_the_expert_size():
    arch = architecture_from_hf(tiny_moe_config(moe_intermediate_size=31))
    with pytest.raises(ValueError, match="moe_intermediate_size=31"):
        check_tp_divides(arch, 2)


def test_expert_parallel_size_must_divide_the_data_parallel_size():
    flags = ["--actor-num-gpus-per-node", "2", "--colocate", "false", "--rollout-num-gpus", "1"]
    assert parse_args(["--expert-model-parallel-size", "2", *flags]).expert_model_parallel_size == 2
    four = {"actor_num_gpus_per_node": 4, "colocate": False, "rollout_num_gpus": 1}
    assert load_config(overrides={**four, "expert_model_parallel_size": 2}).expert_model_parallel_size == 2
    with pytest.raises(ConfigError, match="expert_model_parallel_size=4 does not divide the data-parallel size 2"):
        load_config(overrides={**four, "tensor_model_parallel_size": 2, "expert_model_parallel_size": 4})
