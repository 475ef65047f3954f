"""Build a Megatron-core GPTModel from a Hugging Face config (Qwen2, Qwen3, Llama, Qwen3-MoE, Mixtral):
one Megatron layer (local spec, RMSNorm, SwiGLU, RoPE) with q/k/v biases (Qwen2) or per-head q/k norms
(Qwen3); MoE layers (Qwen3-MoE, Mixtral) replace the MLP with Megatron's MoE layer (top-k router,
sequential experts). The vocabulary is padded to a multiple of the TP size (zero rows, masked before any
softmax, cut on export). What the mapping cannot express exactly is refused with an error naming the config field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from vime_core.trainer import compat_cpu, compat_moe, rope
from vime_core.trainer.attention import SDPACoreAttention
from vime_core.trainer.grouped_experts import GroupedMLP, grouped_mm_available

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


class UnsupportedModelError(ValueError):
    """The HF config describes a model this trainer cannot build exactly."""


@dataclass(frozen=True)
class HFArchitecture:
    """The architecture fields of an HF config that decide the Megatron model's shape."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None  # Llama 3.1-style scaling (None: plain RoPE)
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0  # 0: dense MLP layers; else every layer's MLP is an MoE layer of this many experts
    moe_router_topk: int = 0
    moe_ffn_hidden_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1


def read_hf_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the HF checkpoint folder")
    return json.loads(path.read_text())


# Megatron's RoPE scaling is Llama 3.1's with these constants fixed (RotaryEmbedding._apply_scaling).
LLAMA3_SCALING_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(cfg: dict[str, Any]) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None). transformers 5 keeps RoPE settings in
    ``rope_parameters``; older configs use ``rope_theta`` and ``rope_scaling`` at the top level."""
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        for key, fixed in LLAMA3_SCALING_FIXED.items():
            if float(params.get(key, fixed)) != fixed:
                raise UnsupportedModelError(
                    f"llama3 rope scaling with {key}={params.get(key)} (only {fixed}) is not supported"
                )
        return theta, float(params.get("factor", 8.0))
    raise UnsupportedModelError(
        f"rope_scaling/rope_parameters.rope_type={rope_type!r} is not supported (only 'default' and 'llama3')"
    )


def architecture_from_hf(cfg: dict[str, Any]) -> HFArchitecture:
    """Read and validate an HF config dict."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"architectures={cfg.get('architectures')} (model_type={model_type!r}) is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r} is not supported (only 'silu')")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModelError(
            f"attention_bias=true for model_type={model_type!r} (bias on o_proj) is not supported"
        )
    if cfg.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported")
    if model_type == "mixtral" and cfg.get("sliding_window") is not None:  # Mixtral's window has no switch
        raise UnsupportedModelError(
            f"sliding_window={cfg['sliding_window']} (sliding-window attention) is not supported"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope_theta, rope_scaling_factor = _rope(cfg)
    moe = _moe_fields(cfg) if model_type in MOE_MODEL_TYPES else {}
    return HFArchitecture(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(cfg["intermediate_size"]),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling_factor=rope_scaling_factor,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        **moe,
    )


def _moe_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The expert fields of Qwen3-MoE (``num_experts``, ``moe_intermediate_size``, ``norm_topk_prob``) or
    Mixtral (``num_local_experts``; ``intermediate_size`` is each expert's; top-k probabilities always
    renormalised). Every layer must be sparse: dense layers mixed in (``decoder_sparse_step`` > 1 or
    ``mlp_only_layers``) are refused, as is Mixtral's training-time router jitter."""
    model_type = cfg["model_type"]
    step = int(cfg.get("decoder_sparse_step") or 1)
    if step != 1:
        raise UnsupportedModelError(f"decoder_sparse_step={step} (dense layers between MoE layers) is not supported")
    if cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(f"mlp_only_layers={cfg['mlp_only_layers']} (dense MLP layers) is not supported")
    if float(cfg.get("router_jitter_noise") or 0.0):
        raise UnsupportedModelError(f"router_jitter_noise={cfg['router_jitter_noise']} is not supported (only 0)")
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if experts < 1:
        raise UnsupportedModelError(f"num_experts={experts}: a {model_type} model needs at least one expert")
    topk = int(cfg["num_experts_per_tok"])
    if not 1 <= topk <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok={topk} is not between 1 and num_experts={experts}")
    if model_type == "mixtral":
        return {
            "num_experts": experts,
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(cfg["moe_intermediate_size"]),
        # transformers' Qwen3MoeConfig default; the released Qwen3-MoE checkpoints set it to true
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
    }


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """Smallest multiple of ``tp_size`` that is >= ``vocab_size``."""
    return -(-vocab_size // tp_size) * tp_size


def check_tp_divides(arch: HFArchitecture, tp_size: int) -> None:
    if arch.num_experts:  # Mixtral's intermediate_size is each expert's
        mlp = (
            "intermediate_size" if arch.model_type == "mixtral" else "moe_intermediate_size",
            arch.moe_ffn_hidden_size,
        )
    else:
        mlp = ("intermediate_size", arch.ffn_hidden_size)
    for field, value in (("num_attention_heads", arch.num_heads), ("num_key_value_heads", arch.num_kv_heads), mlp):
        if value % tp_size:
            raise ValueError(f"tensor_model_parallel_size={tp_size} does not divide the model's {field}={value}")


def check_ep_divides(arch: HFArchitecture, ep_size: int) -> None:
    """Each EP rank holds ``num_experts / ep_size`` whole experts; a dense model has none to split."""
    if ep_size == 1:
        return
    if not arch.num_experts:
        raise ValueError(
            f"expert_model_parallel_size={ep_size}: the model (model_type={arch.model_type!r}) has no experts to split"
        )
    if arch.num_experts % ep_size:
        raise ValueError(
            f"expert_model_parallel_size={ep_size} does not divide the model's num_experts={arch.num_experts}"
        )


def transformer_config(
    arch: HFArchitecture,
    tp_size: int,
    dtype: torch.dtype,
    recompute: dict[str, Any] | None = None,
    fusions: dict[str, bool] | None = None,
    router_losses: dict[str, Any] | None = None,
    routing_replay: bool = False,
    ep_size: int = 1,
) -> Any:
    """Megatron's ``TransformerConfig`` for ``arch``: no dropout, weights created on the CPU and
    left uninitialised (a checkpoint is loaded next). ``recompute``: Megatron's activation-recompute
    fields (``recompute_settings(cfg)``). ``fusions``: ``apply_rope_fusion`` (vime's packed RoPE at
    Megatron's hook, ``rope.py``) and ``bias_activation_fusion`` (Megatron's torch.compile'd
    SwiGLU), from ``fusion_settings``; off by default. The other fused kernels need Transformer
    Engine or apex and stay off. MoE models: ``moe_settings`` (``router_losses`` from
    ``router_loss_settings``; none by default; ``routing_replay``: Megatron's routing replay;
    ``ep_size``: expert parallelism, as the parallel state was initialised)."""
    check_tp_divides(arch, tp_size)
    if arch.num_experts:
        check_ep_divides(arch, ep_size)
    fusions = {"apply_rope_fusion": False, "bias_activation_fusion": False, **(fusions or {})}
    if fusions["apply_rope_fusion"]:
        rope.install()  # before the config: its checks look for a fused RoPE
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tp_size,
        sequence_parallel=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype,
        **moe_settings(arch, tp_size, router_losses, routing_replay, ep_size),
        **(recompute or {}),
        **fusions,
    )


def moe_settings(
    arch: HFArchitecture,
    tp_size: int,
    router_losses: dict[str, Any] | None = None,
    routing_replay: bool = False,
    ep_size: int = 1,
) -> dict[str, Any]:
    """Megatron's MoE fields for ``arch`` (none for a dense model).

    HF's router takes softmax over all experts, keeps the top k and (``norm_topk_prob``) divides by
    their sum, which equals a softmax over the k largest logits: Megatron's softmax router with
    ``moe_router_pre_softmax=False``; without the renormalisation it is softmax-then-top-k
    (``moe_router_pre_softmax=True``). Routing in fp32 as slime runs Qwen3-MoE; dropless (no
    capacity factor); the load-balancing and z losses of ``router_losses`` (``router_loss_settings``;
    default none); the allgather dispatcher (the alltoall one needs CUDA streams): it gathers every
    token of the TP x EP ranks, each rank runs its experts on the tokens routed to them and a
    reduce-scatter returns each rank its tokens' outputs. Experts split over ``ep_size`` ranks (each
    holds ``num_experts / ep_size`` whole experts) and each over the TP ranks like the dense MLP
    (expert TP = TP: the same TP split and gradient rule as at EP=1, ``compat_moe``).
    ``routing_replay``: each router gets Megatron's
    ``RouterReplay``, driven by ``vime_core/trainer/routing_replay.py`` (off: routers as before)."""
    if not arch.num_experts:
        return {}
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_router_topk,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_z_loss_coeff": None,
        **(router_losses or {}),
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "expert_model_parallel_size": ep_size,
        "expert_tensor_parallel_size": tp_size,
        **({"moe_enable_routing_replay": True} if routing_replay else {}),
    }


# the router-loss flags' defaults (vime_core/config/schema.py): a dense model accepts only these
ROUTER_LOSS_DEFAULTS = {
    "moe_aux_loss_coeff": 0.0,
    "moe_router_load_balancing_type": "aux_loss",
    "moe_z_loss_coeff": 0.0,
}


def router_loss_settings(cfg: Any) -> dict[str, Any]:
    """The run's router losses, named as in Megatron's ``TransformerConfig``: the load-balancing
    loss of ``moe_router_load_balancing_type`` weighted by ``moe_aux_loss_coeff`` (none when it is 0),
    and the z-loss weighted by ``moe_z_loss_coeff`` (None: off)."""
    coeff = float(cfg.moe_aux_loss_coeff)
    return {
        "moe_router_load_balancing_type": cfg.moe_router_load_balancing_type if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_z_loss_coeff": float(cfg.moe_z_loss_coeff) or None,
    }


def check_router_losses(arch: HFArchitecture, cfg: Any) -> None:
    """A dense ``arch`` has no router: refuse a router-loss flag set away from its default."""
    if arch.num_experts:
        return
    for name, default in ROUTER_LOSS_DEFAULTS.items():
        if getattr(cfg, name) != default:
            raise ValueError(
                f"{name}={getattr(cfg, name)}: the model (model_type={arch.model_type!r}) has no experts to route to"
            )


def check_routing_replay(arch: HFArchitecture, cfg: Any) -> None:
    """A dense ``arch`` routes nothing: refuse ``use_rollout_routing_replay`` on it."""
    if cfg.use_rollout_routing_replay and not arch.num_experts:
        raise ValueError(
            f"use_rollout_routing_replay=true: the model (model_type={arch.model_type!r}) has no experts, "
            "a dense model routes nothing"
        )


def recompute_settings(cfg: Any) -> dict[str, Any]:
    """The run's activation-recompute fields, named as in Megatron's ``TransformerConfig``."""
    return {
        "recompute_granularity": cfg.recompute_granularity,
        "recompute_method": cfg.recompute_method,
        "recompute_num_layers": cfg.recompute_num_layers,
    }


def fusion_settings(cfg: Any, device: torch.device | str) -> dict[str, bool]:
    """The run's kernel fusions, named as in Megatron's ``TransformerConfig``: on CUDA only, where
    they compile (on the CPU the unfused layers are the tested reference)."""
    on_cuda = torch.device(device).type == "cuda"
    return {
        "apply_rope_fusion": bool(cfg.rope_fusion) and on_cuda,
        "bias_activation_fusion": bool(cfg.bias_swiglu_fusion) and on_cuda,
    }


def grouped_experts(cfg: Any, device: torch.device | str) -> bool:
    """Whether MoE layers run their experts as grouped GEMMs: ``moe_grouped_gemm`` where the host
    has the kernel (``grouped_experts.grouped_mm_available``)."""
    return bool(getattr(cfg, "moe_grouped_gemm", False)) and grouped_mm_available(device)


def layer_spec(arch: HFArchitecture, grouped: bool = False) -> Any:
    """The local layer spec with SDPA core attention; MoE models get Megatron's MoE layer with one
    local MLP per expert, run in turn (``SequentialMLP``) or, ``grouped``, as two grouped GEMMs
    (``grouped_experts.GroupedMLP``, the same parameters). Megatron's own grouped experts need
    Transformer Engine or the ``grouped_gemm`` package, absent here."""
    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
    if arch.num_experts and grouped:
        spec.submodules.mlp.submodules.experts.module = GroupedMLP
    return spec


def build_gpt_model(
    arch: HFArchitecture,
    tp_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    recompute: dict[str, Any] | None = None,
    fusions: dict[str, bool] | None = None,
    router_losses: dict[str, Any] | None = None,
    routing_replay: bool = False,
    ep_size: int = 1,
    grouped: bool = False,
) -> Any:
    """A Megatron ``GPTModel`` for this TP (and EP) rank (parallel state must be initialised, with
    ``ep_size`` as its expert-parallel size); ``grouped``: MoE experts as grouped GEMMs (``layer_spec``).

    The output layer returns vocabulary-parallel logits [b, s, padded_vocab / tp].
    """
    compat_cpu.activate()
    if arch.num_experts:
        compat_moe.define_missing_te_gemm()
    model = GPTModel(
        config=transformer_config(arch, tp_size, dtype, recompute, fusions, router_losses, routing_replay, ep_size),
        transformer_layer_spec=layer_spec(arch, grouped),
        vocab_size=padded_vocab_size(arch.vocab_size, tp_size),
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        parallel_output=True,
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=arch.rope_theta,  # type: ignore[arg-type]  (a float is fine: it is only exponentiated)
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    mark_tensor_parallel_params(model)
    norms_in_dtype(model, dtype)
    compat_moe.allow_full_sequence_tp(model)
    compat_moe.pad_tokens_over_ep(model)
    model.vime_hf_arch = arch  # read by hf_convert.iter_hf_weights
    return model.to(device=device)


def norms_in_dtype(model: Any, dtype: torch.dtype) -> int:
    """Give the RMSNorm/LayerNorm weights the model's dtype; how many modules changed.

    Megatron's torch fallback norms (no Transformer Engine) are created in fp32 whatever
    params_dtype says, so in a bf16 model they get bf16 activations with fp32 weights, which
    torch's fused RMSNorm kernel refuses: every norm of every layer then takes the slower path
    ("Mismatch dtype between input and weight" on GPUs). Transformer Engine's norms,
    HF checkpoints and vLLM all hold them in the model's dtype; the optimizer's fp32 main copies
    keep the update's precision."""
    changed = 0
    for module in model.modules():
        if isinstance(module, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            if any(p.dtype != dtype for p in module.parameters(recurse=False)):
                module.to(dtype)
                changed += 1
    return changed


def mark_tensor_parallel_params(model: Any) -> None:
    """Tag TP-split parameters the way Megatron's weight initialisers do.

    With ``perform_initialization=False`` (we load weights right after building) Megatron's
    layers skip ``set_tensor_model_parallel_attributes``, so every parameter looks replicated and
    the grad-norm computation (which counts replicated parameters on TP rank 0 only) drops the
    other ranks' shards. Column-parallel weights/biases and vocabulary-parallel embeddings are
    split on dim 0, row-parallel weights on dim 1 (their biases are replicated).
    """
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            splits = [(getattr(module, "weight", None), 0), (getattr(module, "bias", None), 0)]
        elif isinstance(module, RowParallelLinear):
            splits = [(getattr(module, "weight", None), 1)]
        else:
            continue
        for param, dim in splits:
            if isinstance(param, torch.nn.Parameter) and not hasattr(param, "tensor_model_parallel"):
                set_tensor_model_parallel_attributes(param, True, dim, 1)
