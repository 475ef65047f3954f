"""LoRA's configuration: the HF layer names users give, the Megatron layers they map to, and the
checks that name the flag (called from `derive_in_place`).

Megatron's local layer spec fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``: one
adapter per Megatron layer, so a name of a fused group needs the others of its group.
"""

from __future__ import annotations

from vime_core.config.schema import ConfigFields  # the fields these functions read

# `--max-lora-rank` takes one of these (vLLM's LoRAConfig.max_lora_rank; 0.32 also allows 1): the
# engines' server flag (engines/adapters.py) and this configuration's check read them
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)

ALL_LINEAR = "all-linear"

# Megatron layer -> the HF projections it holds, in HF order (vime_core/trainer/hf_convert.py).
MEGATRON_LAYERS: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attention.linear_proj": ("self_attn.o_proj",),
    "mlp.linear_fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.linear_fc2": ("mlp.down_proj",),
}
HF_NAMES: tuple[str, ...] = tuple(name.split(".")[-1] for group in MEGATRON_LAYERS.values() for name in group)

# Defaults of the fields that have no effect with lora_rank=0.
LORA_FIELDS: dict[str, object] = {
    "lora_alpha": 16.0,
    "lora_dropout": 0.0,
    "target_modules": [ALL_LINEAR],
    "lora_publish": "merged",
}


def lora_enabled(cfg: ConfigFields) -> bool:
    return cfg.lora_rank > 0


def target_names(target_modules: list[str]) -> list[str]:
    """The HF short names of ``target_modules`` (entries may be comma-separated), in HF order."""
    given = {name.strip() for entry in target_modules for name in entry.split(",") if name.strip()}
    if ALL_LINEAR in given:
        return list(HF_NAMES)
    return [name for name in HF_NAMES if name in given]


def megatron_targets(target_modules: list[str]) -> list[str]:
    """The Megatron layers (keys of MEGATRON_LAYERS) that get an adapter."""
    names = set(target_names(target_modules))
    return [layer for layer, group in MEGATRON_LAYERS.items() if names & {n.split(".")[-1] for n in group}]


def check_lora(cfg: ConfigFields, has_critic: bool) -> None:
    """Refuse what LoRA cannot do, one line naming the flag; normalise target_modules to HF names."""
    if cfg.lora_rank < 0:
        raise ValueError(f"lora_rank={cfg.lora_rank} must be >= 0 (0 trains the full weights)")
    if not lora_enabled(cfg):
        for name, default in LORA_FIELDS.items():
            if getattr(cfg, name) != default:
                raise ValueError(f"{name}={getattr(cfg, name)} has no effect without lora_rank > 0")
        return
    given = [name.strip() for entry in cfg.target_modules for name in entry.split(",") if name.strip()]
    unknown = sorted(set(given) - set(HF_NAMES) - {ALL_LINEAR})
    if not given or unknown:
        raise ValueError(
            f"target_modules={','.join(given) or '(empty)'} matches no linear layer"
            f"{' (' + ', '.join(unknown) + ' unknown)' if unknown else ''}; "
            f"use {', '.join(HF_NAMES)} or {ALL_LINEAR}"
        )
    names = set(target_names(cfg.target_modules))
    for layer, group in MEGATRON_LAYERS.items():
        short = [n.split(".")[-1] for n in group]
        if names & set(short) and not set(short) <= names:
            raise ValueError(
                f"target_modules has {', '.join(n for n in short if n in names)} without "
                f"{', '.join(n for n in short if n not in names)}: Megatron fuses {', '.join(short)} in one layer "
                f"({layer.split('.')[-1]}), so they take one adapter together; name all of them"
            )
    cfg.target_modules = [n for n in HF_NAMES if n in names]
    moe_only = {
        "expert_model_parallel_size": cfg.expert_model_parallel_size > 1,
        "use_rollout_routing_replay": cfg.use_rollout_routing_replay,
        "moe_aux_loss_coeff": cfg.moe_aux_loss_coeff > 0,
    }
    for name, given in moe_only.items():
        if given:  # LoRA refuses MoE models at trainer start; a dense model refuses these
            raise ValueError(
                f"lora_rank={cfg.lora_rank} with {name}={getattr(cfg, name)}: {name} is for mixture-of-experts "
                "models, which LoRA does not train"
            )
    if has_critic:
        raise ValueError(
            f"lora_rank={cfg.lora_rank} with advantage_estimator={cfg.advantage_estimator} (a critic) is not "
            "supported: the critic trains full weights; use an estimator without a critic (grpo, ...)"
        )
    if cfg.lora_publish == "adapter" and cfg.check_weight_update_equal and cfg.async_staleness:
        raise ValueError(
            f"check_weight_update_equal with lora_publish=adapter and async_staleness={cfg.async_staleness}: the "
            "check's probe must run with no rollout beside it (vLLM's engine dies computing prompt log-probs "
            "under an adapter in a batch); turn the check off or use async_staleness=0"
        )
    if cfg.lora_publish == "adapter" and cfg.lora_rank > VLLM_LORA_RANKS[-1]:
        raise ValueError(
            f"lora_rank={cfg.lora_rank} with lora_publish=adapter: vLLM serves adapters of rank up to "
            f"{VLLM_LORA_RANKS[-1]}; use lora_publish=merged"
        )
