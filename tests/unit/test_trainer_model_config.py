"""HF config -> Megatron architecture: supported families, clear errors for the rest."""

from __future__ import annotations

import pytest

from vime_core.demo.model import tiny_config
from vime_core.trainer.model import (
    UnsupportedModelError,
    architecture_from_hf,
    check_tp_divides,
    padded_vocab_size,
)


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_families_map_to_their_switches(family):
    arch = architecture_from_hf(tiny_config(family))
    assert arch.qkv_bias == (family == "qwen2")
    assert arch.qk_norm == (family == "qwen3")


def test_unsupported_family_names_model_type():
    cfg = tiny_config("qwen3") | {"model_type": "gpt_neox"}
    with pytest.raises(UnsupportedModelError, match="model_type='gpt_neox'"):
        architecture_from_hf(cfg)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"model_type": "llama", "attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"use_sliding_window": True}, "use_sliding_window"),
    ],
)
def test_inexpressible_configs_name_the_field(change, field):
    with pytest.raises(UnsupportedModelError, match=field):
        architecture_from_hf(tiny_config("qwen3") | change)


def test_rope_theta_from_rope_parameters():
    cfg = tiny_config("qwen3") | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    cfg.pop("rope_theta")
    assert architecture_from_hf(cfg).rope_theta == 5e5


@pytest.mark.parametrize("vocab,tp", [(19, 1), (19, 2), (20, 2), (151936, 8), (7, 4)])
def test_padded_vocab_is_smallest_multiple_of_tp(vocab, tp):
    padded = padded_vocab_size(vocab, tp)
    assert padded % tp == 0 and vocab <= padded < vocab + tp


def test_tp_must_divide_kv_heads():
    arch = architecture_from_hf(tiny_config("llama", num_heads=4, num_kv_heads=1))
    with pytest.raises(ValueError, match="num_key_value_heads=1"):
        check_tp_divides(arch, 2)


def test_llama3_rope_scaling_is_read_and_other_constants_refused():
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    arch = architecture_from_hf(tiny_config("llama") | {"rope_scaling": scaling})
    assert arch.rope_scaling_factor == 32.0
    assert architecture_from_hf(tiny_config("llama")).rope_scaling_factor is None
    with pytest.raises(UnsupportedModelError, match="original_max_position_embeddings=4096"):
        architecture_from_hf(
            tiny_config("llama") | {"rope_scaling": scaling | {"original_max_position_embeddings": 4096}}
        )


def test_a_bf16_model_keeps_its_norm_weights_in_bf16(tiny_model_dir):
    """Megatron's torch fallback builds RMSNorm in fp32; a bf16 model would then feed bf16
    activations to fp32 weights (torch's fused kernel refuses the mix: slow path on GPUs)."""
    import torch

    from vime_core.trainer.model import architecture_from_hf, build_gpt_model, read_hf_config
    from vime_core.trainer.parallel import destroy_parallel, free_port, init_parallel

    init_parallel(0, 1, "127.0.0.1", free_port(), 1, "cpu")
    try:
        arch = architecture_from_hf(read_hf_config(tiny_model_dir))
        model = build_gpt_model(arch, 1, torch.bfloat16, torch.device("cpu"))
    finally:
        destroy_parallel()  # the rest of the session starts without a process group
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm)]
    assert norms and all(p.dtype == torch.bfloat16 for m in norms for p in m.parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
