"""Derived configuration values and cross-field checks, computed in one place: VimeConfig
(config/loader.py) calls `derive_in_place` whenever one is made; the functions here read only the
schema's fields. Contradictions raise ValueError naming the fields."""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from typing import Callable
from urllib.parse import urlsplit

from vime_core.algo import get_adv_estimator  # the package: the built-in estimators registered
from vime_core.algo.registry import registered_adv_estimators
from vime_core.config.lora import check_lora
from vime_core.algo.shaping import check_overlong_buffer
from vime_core.builtin_rewards import BUILTIN_REWARDS
from vime_core.config.optimizer import critic_only_steps, derive_optimizer
from vime_core.config.schema import ConfigFields  # the fields these functions read
from vime_core.utils.secrets import carries_userinfo, redact_url
from vime_core.wire.broadcast_format import BACKEND_NAME as BROADCAST
from vime_core.wire.shm_format import BACKEND_NAME as SHM

logger = logging.getLogger(__name__)


def trainer_num_devices(cfg: ConfigFields) -> int:
    return cfg.actor_num_nodes * cfg.actor_num_gpus_per_node


def dp_size(cfg: ConfigFields) -> int:
    return trainer_num_devices(cfg) // cfg.tensor_model_parallel_size


def num_engines(cfg: ConfigFields) -> int:
    return cfg.rollout_num_gpus // cfg.rollout_num_gpus_per_engine


def rollout_concurrency(cfg: ConfigFields) -> int:
    return cfg.vllm_server_concurrency * num_engines(cfg)


def samples_per_rollout(cfg: ConfigFields) -> int:
    return cfg.rollout_batch_size * cfg.n_samples_per_prompt


def platform_supports_sleep(cfg: ConfigFields) -> bool:
    """vLLM's sleep mode frees memory through CUDA's allocator; the CPU build has none."""
    return cfg.device == "cuda"


# Every flag whose code reads the batch's rollout_log_probs column (the engines' log-prob of each
# sampled token). A new reader must be listed here: the rollout requests log-probs from the
# engines, and the trainability check requires them, only for the flags in this tuple.
ROLLOUT_LOGPROB_FLAGS: tuple[str, ...] = (
    "use_rollout_logprobs",  # the engines' log-probs are the old policy (loss and KL penalty)
    "use_tis",  # the IS weight of exp(old - rollout) at tis_level / tis_mode (refused without use_tis)
    "get_mismatch_metrics",  # train_rollout_logprob_abs_diff
)


def rollout_logprob_readers(cfg: ConfigFields) -> list[str]:
    """The flags of ROLLOUT_LOGPROB_FLAGS that are set, in that order (empty: none reads the
    engines' log-probs)."""
    return [name for name in ROLLOUT_LOGPROB_FLAGS if getattr(cfg, name)]


def needs_rollout_logprobs(cfg: ConfigFields) -> bool:
    """Whether rollouts request each sampled token's log-prob from the engines (vLLM's
    `logprobs: 0`): only when a flag of ROLLOUT_LOGPROB_FLAGS is set. Otherwise samples carry
    none (an empty rollout_log_probs), which costs the engines nothing."""
    return bool(rollout_logprob_readers(cfg))


def check_layout(trainer_devices: int, rollout_devices: int, devices_per_engine: int, colocate: bool) -> None:
    """Raise naming the fields when the engines' devices cannot be laid out (derive_in_place
    and the placement plan, vime_core/cluster/placement.py, both call it)."""
    if rollout_devices % devices_per_engine:
        raise ValueError(
            f"rollout_num_gpus_per_engine={devices_per_engine} does not divide rollout_num_gpus={rollout_devices}"
        )
    if colocate and rollout_devices != trainer_devices:
        raise ValueError(
            f"colocate needs rollout_num_gpus ({rollout_devices}) equal to the trainer's "
            f"devices ({trainer_devices}); set colocate=false to place engines elsewhere"
        )


def derive_in_place(cfg: ConfigFields) -> None:
    """Fill the derived fields of `cfg` and run the cross-field checks:

        global_batch_size        = rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout
        eps_clip_high            = eps_clip                       (when unset)
        over_sampling_batch_size = rollout_batch_size             (when unset)
        rollout_max_context_len  = rollout_max_prompt_len + rollout_max_response_len (when unset)
        vllm_enforce_eager       = device == "cpu"                (when unset)
        rollout_num_gpus         = trainer devices when colocated, else 1 (when unset)
        critic_lr                = lr                             (when unset, with a critic)
        loss_scale_factor        = rollout_max_response_len       (when unset, seq_mean_token_sum_norm)

    lr_decay_iters and the recompute defaults: vime_core/config/optimizer.py."""
    rollout_samples = samples_per_rollout(cfg)
    if cfg.num_steps_per_rollout is not None:
        if rollout_samples % cfg.num_steps_per_rollout:
            raise ValueError(
                f"num_steps_per_rollout={cfg.num_steps_per_rollout} does not divide "
                f"rollout_batch_size*n_samples_per_prompt={rollout_samples}"
            )
        derived = rollout_samples // cfg.num_steps_per_rollout
        if cfg.global_batch_size is not None and cfg.global_batch_size != derived:
            raise ValueError(
                f"global_batch_size={cfg.global_batch_size} contradicts num_steps_per_rollout="
                f"{cfg.num_steps_per_rollout} (rollout_batch_size*n_samples_per_prompt//"
                f"num_steps_per_rollout = {derived}); set only one of them"
            )
        cfg.global_batch_size = derived
    elif cfg.global_batch_size is None:
        raise ValueError("set num_steps_per_rollout or global_batch_size")
    elif rollout_samples % cfg.global_batch_size:
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} does not divide "
            f"rollout_batch_size*n_samples_per_prompt={rollout_samples}"
        )
    else:
        cfg.num_steps_per_rollout = rollout_samples // cfg.global_batch_size

    if cfg.vllm_enforce_eager is None:
        cfg.vllm_enforce_eager = cfg.device == "cpu"
    if cfg.eps_clip_high is None:
        cfg.eps_clip_high = cfg.eps_clip
    if cfg.over_sampling_batch_size is None:
        cfg.over_sampling_batch_size = cfg.rollout_batch_size
    if cfg.rollout_max_context_len is None:
        cfg.rollout_max_context_len = cfg.rollout_max_prompt_len + cfg.rollout_max_response_len
    if cfg.rollout_max_context_len < cfg.rollout_max_prompt_len + 1:
        raise ValueError(
            f"rollout_max_context_len={cfg.rollout_max_context_len} leaves no room to generate "
            f"after a prompt of rollout_max_prompt_len={cfg.rollout_max_prompt_len}"
        )

    devices = trainer_num_devices(cfg)
    if devices % cfg.tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size={cfg.tensor_model_parallel_size} does not divide the "
            f"trainer's {devices} devices (actor_num_nodes*actor_num_gpus_per_node)"
        )
    if cfg.rollout_num_gpus is None:
        cfg.rollout_num_gpus = devices if cfg.colocate else 1
    check_layout(devices, cfg.rollout_num_gpus, cfg.rollout_num_gpus_per_engine, cfg.colocate)
    if cfg.global_batch_size % dp_size(cfg):
        raise ValueError(
            f"global_batch_size={cfg.global_batch_size} is not divisible by the data-parallel size {dp_size(cfg)}"
        )
    if cfg.use_dynamic_batch_size and cfg.max_tokens_per_gpu is None:
        raise ValueError("use_dynamic_batch_size needs max_tokens_per_gpu")
    if cfg.eps_clip_c is not None and cfg.eps_clip_c <= 1.0:
        raise ValueError(f"eps_clip_c={cfg.eps_clip_c} must be > 1")
    check_rm_type(cfg)
    if dp_size(cfg) % cfg.expert_model_parallel_size:  # Megatron: TP x EP divides the world (expert TP = TP)
        raise ValueError(
            f"expert_model_parallel_size={cfg.expert_model_parallel_size} does not divide the data-parallel size "
            f"{dp_size(cfg)} (the trainer's {devices} devices / tensor_model_parallel_size)"
        )
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type == "none":
        raise ValueError(
            f"moe_aux_loss_coeff={cfg.moe_aux_loss_coeff} needs a load-balancing loss: "
            "moe_router_load_balancing_type is none (use aux_loss or seq_aux_loss)"
        )
    _check_routing_replay(cfg)
    derive_optimizer(cfg)
    _check_sft(cfg)
    _check_estimator_fields(cfg)
    _check_kl(cfg)
    _check_tis(cfg)
    _check_opd(cfg)
    _check_async_staleness(cfg)
    _check_loss_scale(cfg)
    check_overlong_buffer(cfg)
    _check_weight_transport(cfg)
    engine_env(cfg)  # refuses a malformed, secret-looking or vime-managed vllm_env entry
    _check_urls(cfg)
    _check_run_settings(cfg)
    _check_vllm_extra_args(cfg)
    _check_hook_paths(cfg)
    _check_critic(cfg)
    check_lora(cfg, get_adv_estimator(cfg.advantage_estimator).critic)
    _check_group_size(cfg)
    _check_fill_bound(cfg)
    check_engine_auth(cfg)


def _check_fill_bound(cfg: ConfigFields) -> None:
    """max_num_gen_batches batches of over_sampling_batch_size groups must be able to hold
    rollout_batch_size groups even when the filter keeps every group: a rollout that can never
    fill is refused before the run starts, not at its first iteration."""
    if cfg.max_num_gen_batches * cfg.over_sampling_batch_size < cfg.rollout_batch_size:
        need = -(-cfg.rollout_batch_size // cfg.over_sampling_batch_size)
        raise ValueError(
            f"max_num_gen_batches={cfg.max_num_gen_batches} batches of over_sampling_batch_size="
            f"{cfg.over_sampling_batch_size} groups cannot hold rollout_batch_size="
            f"{cfg.rollout_batch_size} groups: set max_num_gen_batches >= {need} or a larger "
            f"over_sampling_batch_size"
        )


def _check_group_size(cfg: ConfigFields) -> None:
    """A group-relative estimator (its group_normalisation subtracts a group baseline) needs two
    samples per prompt: in a group of one every advantage is 0 by construction, so the run would
    train on nothing."""
    estimator = get_adv_estimator(cfg.advantage_estimator)
    if estimator.group_normalisation != "none" and cfg.n_samples_per_prompt < 2:
        raise ValueError(
            f"n_samples_per_prompt={cfg.n_samples_per_prompt} with advantage_estimator={estimator.name}: its "
            f"baseline is the mean reward of the sample's group, so a group of one gives every advantage 0; "
            f"set n_samples_per_prompt >= 2 or an estimator without a group baseline (reinforce_plus_plus, ppo)"
        )


# The critic's fields (schema.py, "critic") with their defaults: any other value needs a critic.
CRITIC_FIELDS: dict[str, object] = {
    "critic_load": None,
    "critic_save": None,
    "critic_lr": None,
    "critic_lr_warmup_iters": 0,
    "num_critic_only_steps": 0,
    "value_clip": 0.2,
}


def _check_critic(cfg: ConfigFields) -> None:
    """The critic's settings only with an estimator that has one (ppo); with it, critic_lr
    defaults to lr and its schedule must be one Megatron's scheduler accepts (as lr's,
    config/optimizer.py); local critic_load and critic_save paths are made absolute. Needs
    lr_decay_iters derived."""
    estimator = get_adv_estimator(cfg.advantage_estimator)
    if not estimator.critic:
        _refuse_set(cfg, CRITIC_FIELDS, f"a critic (advantage_estimator=ppo; it is {cfg.advantage_estimator})")
        return
    if cfg.loss_type != "policy_loss":
        raise ValueError(
            f"advantage_estimator={estimator.name} trains a critic for the policy loss; "
            f"loss_type={cfg.loss_type} has no advantages"
        )
    if cfg.critic_lr is None:
        cfg.critic_lr = cfg.lr
    if cfg.min_lr > cfg.critic_lr:
        raise ValueError(
            f"critic_lr={cfg.critic_lr} is below min_lr={cfg.min_lr}; the decay goes from it down to min_lr"
        )
    if cfg.lr_warmup_init > cfg.critic_lr:
        raise ValueError(
            f"critic_lr={cfg.critic_lr} is below lr_warmup_init={cfg.lr_warmup_init}; warmup rises from it"
        )
    critic_decay = cfg.lr_decay_iters + critic_only_steps(cfg)  # the critic's schedule (trainer/critic.py)
    if cfg.critic_lr_warmup_iters and cfg.critic_lr_warmup_iters >= critic_decay:
        raise ValueError(
            f"critic_lr_warmup_iters={cfg.critic_lr_warmup_iters} is not fewer than the critic's decay steps "
            f"{critic_decay} (lr_decay_iters={cfg.lr_decay_iters} and the critic-only rollouts' steps)"
        )
    for field in ("critic_load", "critic_save"):  # relative to where the run was started: the actors run elsewhere
        path = getattr(cfg, field)
        if path and "://" not in path:
            setattr(cfg, field, os.path.abspath(os.path.expanduser(path)))


def _refuse_set(cfg: ConfigFields, defaults: dict[str, object], without: str) -> None:
    """A field of `defaults` set to another value has no effect `without` what it belongs to."""
    for name, default in defaults.items():
        if getattr(cfg, name) != default:
            raise ValueError(f"{name}={getattr(cfg, name)} has no effect without {without}")


# What only the policy loss reads (train_step.py): with loss_type=sft_loss, minus the log-probability of
# the response, each would be computed (a teacher, a reference, rollout log-probs) and thrown away.
# (eps_clip_high too, which is eps_clip unless set: _check_sft)
POLICY_LOSS_FIELDS = (
    "eps_clip",
    "eps_clip_c",
    "kl_coef",
    "use_tis",
    "use_opd",
    "use_rollout_logprobs",
)


def _defaults(*names: str) -> dict[str, object]:
    return {name: ConfigFields.model_fields[name].default for name in names}


def _check_sft(cfg: ConfigFields) -> None:
    if cfg.loss_type == "sft_loss":
        without = "loss_type=policy_loss (sft_loss is minus the log-probability of the response)"
        _refuse_set(cfg, _defaults(*POLICY_LOSS_FIELDS), without)
        _refuse_set(cfg, {"eps_clip_high": cfg.eps_clip}, without)  # derived: eps_clip unless set


def _estimators(**registration: object) -> str:
    """The registered estimators whose registration has these values, named for a message."""
    names = [
        n
        for n in registered_adv_estimators()
        if all(getattr(get_adv_estimator(n), key) == value for key, value in registration.items())
    ]
    return ", ".join(names)


def _check_estimator_fields(cfg: ConfigFields) -> None:
    """A setting the chosen estimator and its policy loss never read (algo/advantages.py, losses.py), set
    to another value than its default, is refused: gamma discounts token rewards, lambd is GAE's,
    grpo_std_normalization divides by a group's std, and cispo clips only above (eps_clip_high,
    else eps_clip) and has no dual clip."""
    estimator = get_adv_estimator(cfg.advantage_estimator)
    which = f"(advantage_estimator is {estimator.name})"
    if not estimator.token_rewards:
        _refuse_set(cfg, _defaults("gamma"), f"token rewards: {_estimators(token_rewards=True)} {which}")
    if not estimator.critic:
        _refuse_set(cfg, _defaults("lambd"), f"GAE: {_estimators(critic=True)} {which}")
    if estimator.group_normalisation != "mean_std":
        _refuse_set(
            cfg,
            _defaults("grpo_std_normalization"),
            f"a group std normalisation: {_estimators(group_normalisation='mean_std')} {which}",
        )
    if estimator.policy_loss == "cispo":
        _refuse_set(cfg, _defaults("eps_clip_c"), f"a dual clip, which the cispo loss has not {which}")
        if cfg.eps_clip_high != cfg.eps_clip:  # eps_clip_high set apart: eps_clip is not cispo's upper clip
            _refuse_set(cfg, _defaults("eps_clip"), f"a lower clip, which the cispo loss has not {which}")


# The remote reward model's settings (rewards/hub.py reads them with rm_type=remote_rm only).
REMOTE_RM_FIELDS = ("rm_url", "rm_api_key_env", "rm_api_key_file", "rm_timeout_s")


def unused_settings(cfg: ConfigFields) -> list[str]:
    """Settings given a value that this run never reads, one line each for the run's start to warn
    with (flows/train.py), the values left out (they locate or hold credentials): the remote reward
    model's without rm_type=remote_rm (a custom_rm_path overrides rm_type), and settings read only
    beside another that is off (`_READ_ONLY_WITH`). Warned, not refused: none of them changes what
    is trained, and a run's configuration often keeps them while the feature is switched off."""
    lines = []
    if cfg.rm_type != "remote_rm" or cfg.custom_rm_path:
        reward = f"custom_rm_path={cfg.custom_rm_path!r}" if cfg.custom_rm_path else f"rm_type={cfg.rm_type!r}"
        lines += [
            f"{name} is set but unused: the rewards come from {reward}; only rm_type=remote_rm calls the remote model"
            for name, default in _defaults(*REMOTE_RM_FIELDS).items()
            if getattr(cfg, name) != default
        ]
    for fields, needs, reads in _READ_ONLY_WITH:
        if not reads(cfg):
            lines += [
                f"{name} is set but unused: it is read only with {needs}"
                for name, default in _defaults(*fields).items()
                if getattr(cfg, name) != default
            ]
    return lines


# (settings, what reads them, whether that is on): unused_settings' second part
_READ_ONLY_WITH: tuple[tuple[tuple[str, ...], str, Callable[[ConfigFields], bool]], ...] = (
    (("kl_loss_type",), "a KL term (use_kl_loss=true, or kl_coef > 0)", lambda c: c.use_kl_loss or c.kl_coef > 0),
    (("guard_retries",), "guard_action=rollback", lambda c: c.guard_action == "rollback"),
    (
        ("eval_prompt_data", "eval_prompt_data_split", "n_samples_per_eval_prompt", "eval_temperature"),
        "eval_interval",
        lambda c: c.eval_interval is not None,
    ),
    (
        ("wandb_project", "wandb_group", "wandb_run_name", "wandb_mode", "wandb_dir"),
        "use_wandb=true",
        lambda c: c.use_wandb,
    ),
)


def check_rm_type(cfg: ConfigFields) -> None:
    """Without custom_rm_path, rm_type names a built-in reward (and remote_rm has its rm_url): a
    typo fails here, in one line naming the field, not after the engines have started."""
    if cfg.custom_rm_path:
        return
    if cfg.rm_type not in BUILTIN_REWARDS:
        raise ValueError(
            f"rm_type={cfg.rm_type!r} is unknown; known: {', '.join(sorted(BUILTIN_REWARDS))} (or set custom_rm_path)"
        )
    if cfg.rm_type == "remote_rm" and not cfg.rm_url:
        raise ValueError("rm_type=remote_rm needs rm_url")


def _check_kl(cfg: ConfigFields) -> None:
    """slime's meaning of the KL settings: kl_coef is the penalty in the token rewards, the loss
    term is use_kl_loss + kl_loss_coef. A setting that would silently do nothing is refused."""
    if cfg.kl_coef > 0 and not get_adv_estimator(cfg.advantage_estimator).token_rewards:
        raise ValueError(
            f"kl_coef={cfg.kl_coef} is the KL penalty in the token rewards (as in slime), which "
            f"advantage_estimator={cfg.advantage_estimator} does not have; for a KL term in the loss "
            f"set use_kl_loss=true and kl_loss_coef={cfg.kl_coef} instead"
        )
    if cfg.kl_loss_coef > 0 and not cfg.use_kl_loss:
        raise ValueError(f"kl_loss_coef={cfg.kl_loss_coef} has no effect without use_kl_loss=true")
    if cfg.ref_load and not (cfg.use_kl_loss or cfg.kl_coef > 0):
        raise ValueError(
            f"ref_load={cfg.ref_load!r} is set but no KL term uses the reference (set use_kl_loss=true or kl_coef > 0)"
        )
    if cfg.ref_load and "://" not in cfg.ref_load:
        # relative to where the run was started: the trainer actors run elsewhere
        cfg.ref_load = os.path.abspath(os.path.expanduser(cfg.ref_load))


def _check_tis(cfg: ConfigFields) -> None:
    """The use_tis family (slime's flags): its level, mode and lower bound only with it, and not
    beside use_rollout_logprobs, where the old policy is the engine's and every weight is 1."""
    if not cfg.use_tis:
        _refuse_set(
            cfg, {"tis_level": "token", "tis_mode": "truncate", "tis_clip": 2.0, "tis_clip_low": None}, "use_tis=true"
        )
        return
    if cfg.use_rollout_logprobs:
        raise ValueError(
            "use_tis=true with use_rollout_logprobs=true: the old policy is then the engine's, so every "
            "weight exp(old - rollout) is 1 (slime refuses the pair too)"
        )
    if cfg.tis_clip_low is not None:
        if cfg.tis_mode != "mask":
            raise ValueError(f"tis_clip_low={cfg.tis_clip_low} has no effect without tis_mode=mask")
        if cfg.tis_clip_low >= cfg.tis_clip:
            raise ValueError(f"tis_clip_low={cfg.tis_clip_low} must be below tis_clip={cfg.tis_clip}")


def _check_async_staleness(cfg: ConfigFields) -> None:
    """One step off-policy overlaps a rollout with training: the engines must be awake while the
    trainer trains, and the lag of the sampling weights must be corrected."""
    if not cfg.async_staleness:
        return
    if cfg.offload_rollout and platform_supports_sleep(cfg):
        raise ValueError(
            f"async_staleness={cfg.async_staleness} needs engines that stay awake while the trainer "
            "trains: add --no-offload-rollout (memory permitting) or give the engines their own GPUs"
        )
    if not (cfg.use_tis or cfg.use_rollout_logprobs):
        raise ValueError(
            f"async_staleness={cfg.async_staleness} trains on samples of the previous weights: add "
            "--use-tis (or --use-rollout-logprobs) to correct for it"
        )


def _check_opd(cfg: ConfigFields) -> None:
    """slime's checks of the --use-opd family: the type and teacher with use_opd, none of the
    family without it (a teacher that would be loaded and never used)."""
    if not cfg.use_opd:
        if cfg.opd_teacher_load:
            raise ValueError(
                f"opd_teacher_load={cfg.opd_teacher_load!r} is set but use_opd is not: "
                f"add --use-opd --opd-type megatron (slime refuses it too)"
            )
        _refuse_set(cfg, {"opd_type": None, "opd_kl_coef": 1.0}, "use_opd=true")
        return
    if cfg.opd_type is None:
        raise ValueError(
            "use_opd=true needs --opd-type: megatron (the trainer forwards the teacher of "
            "--opd-teacher-load); sglang, a teacher on an external server, is not provided"
        )
    if not cfg.opd_teacher_load:
        raise ValueError(
            "use_opd=true with opd_type=megatron needs --opd-teacher-load: the teacher's HF "
            "checkpoint (a folder or hub id, with the student's vocabulary)"
        )


def _check_loss_scale(cfg: ConfigFields) -> None:
    """loss_scale_factor is the constant of seq_mean_token_sum_norm only (default: the response budget)."""
    if cfg.loss_agg_mode != "seq_mean_token_sum_norm":
        if cfg.loss_scale_factor is not None:
            raise ValueError(
                f"loss_scale_factor={cfg.loss_scale_factor} has no effect without loss_agg_mode=seq_mean_token_sum_norm"
            )
        return
    if cfg.loss_scale_factor is None:
        cfg.loss_scale_factor = float(cfg.rollout_max_response_len)


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1); a wildcard (0.0.0.0, ::, empty) or
    any other name is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_engine_auth(cfg: ConfigFields) -> None:
    """Nothing vime starts listens beyond loopback unauthenticated: engine_auth=false with an
    engine_bind_host that is not loopback is refused, unless allow_unauthenticated_engines, and
    then a warning names what is open. Servers vime does not start (engine_urls) are not bound
    by vime: the check does not apply to them."""
    if cfg.engine_auth or cfg.engine_urls or is_loopback(cfg.engine_bind_host):
        return
    if not cfg.allow_unauthenticated_engines:
        raise ValueError(
            f"engine_bind_host={cfg.engine_bind_host!r} is beyond loopback and engine_auth=false: anyone who reaches "
            f"an engine's port could generate, pause it and load weights into it; keep engine_auth on (the default), "
            f"bind 127.0.0.1, or add --allow-unauthenticated-engines to accept that"
        )
    logger.warning(
        "engine_auth=false with engine_bind_host=%r (allow_unauthenticated_engines): every route of every engine is "
        "open to anyone who reaches its port (each engine's URL is in the startup log): generate, /collective_rpc "
        "(loads weights from any path), /sleep, /wake_up, /pause and the weight-update session, whose payloads are "
        "unpickled (VLLM_ALLOW_INSECURE_SERIALIZATION)",
        cfg.engine_bind_host,
    )


def _vllm_backends() -> dict[str, str | None]:
    """transport -> the vLLM weight-transfer backend the engines start with (None: none needed)."""
    return {"ipc": "ipc", "nccl": BROADCAST, "gloo": BROADCAST, "shm": SHM, "disk": None}


def weight_transport(cfg: ConfigFields) -> str:
    """The weight-transfer path by placement: CUDA IPC when colocated on GPUs, shared memory on
    CPU, NCCL when engines live on other devices; gloo and disk only when asked."""
    if cfg.weight_transport != "auto":
        return cfg.weight_transport
    if cfg.device == "cpu":
        return "shm"
    return "ipc" if cfg.colocate else "nccl"


def _check_weight_transport(cfg: ConfigFields) -> None:
    """A transport the placement cannot use is refused when the configuration is made."""
    if cfg.device == "cpu" and cfg.weight_transport in ("ipc", "nccl"):
        raise ValueError(
            f"weight_transport={cfg.weight_transport} needs CUDA engines; on CPU use shm "
            f"(engines on the trainer's machine), gloo (engines elsewhere) or disk"
        )
    if cfg.engine_urls and cfg.colocate and cfg.device == "cuda":
        raise ValueError(
            "engine_urls with colocate=true: attached engines run outside the trainer's placement, so they can "
            "neither share its GPUs (CUDA IPC) nor be put to sleep for its steps; set colocate=false"
        )
    if cfg.weight_transport == "nccl" and cfg.colocate:
        raise ValueError(
            "weight_transport=nccl with colocate=true: the trainer's rank 0 and an engine worker "
            "would share a GPU, which one NCCL group cannot hold; colocated engines take ipc"
        )


# What EngineServer.environment sets itself (vime_core/engines/server.py): vllm_env may not
# change them (the device binding, the dev-mode routes and offline mode a run relies on).
ENGINE_MANAGED_ENV = frozenset(
    {
        "VLLM_SERVER_DEV_MODE",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "PYTHONPATH",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_CPU_OMP_THREADS_BIND",
        "VLLM_ENABLE_V1_MULTIPROCESSING",  # a one-rank CPU engine's process layout (EngineServer.cpu_cores)
        "OMP_NUM_THREADS",  # the same engine's threads: one per core it is pinned to
        "LD_PRELOAD",
        "CUDA_VISIBLE_DEVICES",
        "VIME_ENGINE_TOKEN",
        "VIME_ENGINE_OPEN_HEALTH",  # engine_auth (vime_core/engines/vllm_side/auth.py)
    }
)
# what every engine is given unless vllm_env or the actor's environment names it
ENGINE_DEFAULT_ENV = frozenset({"TRITON_CACHE_DIR"})  # one kernel cache, hit or miss (engines/vllm_cache.py)


def _check_run_settings(cfg: ConfigFields) -> None:
    """Settings that would run and do nothing, or fail only after the engines started:
    - max_tokens_per_gpu bounds a micro-batch only with use_dynamic_batch_size;
    - eps_clip >= 1 puts the lower ratio bound 1 - eps_clip at or below 0, where it never clips;
    - a start_rollout_id at or past num_rollout runs no iteration (and reports success);
    - eval_interval with the user's prompt_data and no eval_prompt_data fails at the first eval
      (always due at the last rollout, before its checkpoint);
    - vLLM refuses every request with an empty stop string (the run would retry iteration 0);
    - storage_uri is a local folder, file://... or scheme://bucket/... with a lower-case scheme
      (`s3:/bucket` would be a local folder named `s3:`; "" the filesystem's root)."""
    if cfg.max_tokens_per_gpu is not None and not cfg.use_dynamic_batch_size:
        raise ValueError(
            f"max_tokens_per_gpu={cfg.max_tokens_per_gpu} has no effect without use_dynamic_batch_size=true "
            "(micro-batches are then micro_batch_size samples)"
        )
    if cfg.eps_clip >= 1:
        raise ValueError(f"eps_clip={cfg.eps_clip}: the lower ratio bound 1 - eps_clip is <= 0, so it never clips")
    if cfg.start_rollout_id is not None and cfg.start_rollout_id >= cfg.num_rollout:
        raise ValueError(
            f"start_rollout_id={cfg.start_rollout_id} is at or past num_rollout={cfg.num_rollout}: "
            f"no iteration would run (rollout ids 0 .. {cfg.num_rollout - 1})"
        )
    if cfg.eval_interval and cfg.prompt_data and not cfg.eval_prompt_data:
        raise ValueError(
            f"eval_interval={cfg.eval_interval} needs eval_prompt_data with your own prompt_data (only the "
            "embedded task brings an eval set); without it the run would fail at its first eval rollout"
        )
    if "" in cfg.rollout_stop:
        raise ValueError(f"rollout_stop[{cfg.rollout_stop.index('')}] is empty: vLLM refuses an empty stop string")
    uri = cfg.storage_uri
    scheme, sep, _ = uri.partition("://")
    if not uri.strip():
        raise ValueError("storage_uri is empty: give a local folder or s3://bucket/prefix")
    if sep and scheme != scheme.lower():
        raise ValueError(f"storage_uri: write its scheme {scheme!r} in lower case ({scheme.lower()}://...)")
    one_slash = re.match(r"(s3a?|gcs?|file|az|abfs|hf|memory):/(?!/)", uri, re.IGNORECASE)
    if one_slash:
        raise ValueError(
            f"storage_uri begins {one_slash.group(0)!r}, one slash after the scheme, so it would be a local folder "
            f"named {one_slash.group(1) + ':'!r}: write {one_slash.group(1)}://..."
        )


# The vLLM server options vime sets itself (engines/server.EngineServer.command) and where each
# comes from: appended after them, vllm_extra_args would win, and the engine would differ from what
# the trainer and the checks assume (another dtype or log-prob mode: other log-probs than the
# recompute's; another port: a start that waits out its timeout).
VIME_MANAGED_VLLM_FLAGS = {  # flag: the field to set instead, or why vime alone sets it
    "--model": "hf_checkpoint",
    "--host": "engine_bind_host",
    "--port": "(a free port vime picks per engine)",
    "--max-model-len": "rollout_max_context_len",
    "--logprobs-mode": "(processed_logprobs: the log-probs the trainer recomputes)",
    "--tensor-parallel-size": "rollout_num_gpus_per_engine",
    "--seed": "seed",
    "--dtype": "bf16",
    "--gpu-memory-utilization": "vllm_gpu_memory_utilization",
    "--enforce-eager": "vllm_enforce_eager",
    "--worker-extension-cls": "(vime's worker extension: weight checks and versions)",
    "--weight-transfer-config": "weight_transport",
    "--middleware": "engine_auth",
}


def _check_vllm_extra_args(cfg: ConfigFields) -> None:
    """vllm_extra_args adds options; it does not replace those vime sets (VIME_MANAGED_VLLM_FLAGS)."""
    for i, word in enumerate(cfg.vllm_extra_args):
        if not word.strip():
            raise ValueError(f"vllm_extra_args[{i}] is empty")
        flag = word.split("=", 1)[0]
        source = VIME_MANAGED_VLLM_FLAGS.get(flag)
        if source is not None:
            instead = f"vime sets it {source}" if source.startswith("(") else f"set {source} instead"
            raise ValueError(f"vllm_extra_args[{i}] sets {flag}, which vime sets for every engine: {instead}")


HOOK_FIELDS = (
    "rollout_function_path",
    "custom_generate_function_path",
    "dynamic_sampling_filter_path",
    "custom_rm_path",
)


def _check_hook_paths(cfg: ConfigFields) -> None:
    """A hook is `package.module:function` or `file.py:function` (utils/imports.load_function):
    one of another shape is refused here, not once the RolloutManager loads it after the engines
    started."""
    for field in HOOK_FIELDS:
        value = getattr(cfg, field)
        module, colon, function = value.partition(":")
        if value and (not colon or ":" in function or not module.strip() or not function.strip()):
            raise ValueError(
                f"{field}={value!r}: expected 'package.module:function' or 'file.py:function' (exactly one ':')"
            )


def _check_urls(cfg: ConfigFields) -> None:
    """A vllm_cache_uri that carries credentials (scheme://user:secret@host/...) is refused without
    echoing it: it is stored with the run's configuration (rm_url's and engine_urls' are redacted
    there, as their servers may take them). Each of engine_urls is an http(s)://host[:port] URL,
    given once: an empty entry, as from an unset shell variable, would start vime's own engines
    past the engine_auth check."""
    if carries_userinfo(cfg.vllm_cache_uri):
        raise ValueError(
            "vllm_cache_uri carries credentials in its host part: refused (it is stored with the run's "
            "configuration); give them as for storage_uri (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile)"
        )
    seen: dict[str, int] = {}
    for i, url in enumerate(cfg.engine_urls):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine_urls[{i}]={redact_url(url)!r} is not an http(s)://host:port URL")
        same = seen.setdefault(redact_url(url), i)
        if same != i:
            raise ValueError(
                f"engine_urls[{i}] is engine_urls[{same}] again ({redact_url(url)}): give each engine once"
            )


_SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


def engine_env(cfg: ConfigFields) -> dict[str, str]:
    """vllm_env as {NAME: VALUE}; ValueError naming the entry when it is not NAME=VALUE, names a
    secret (stored with the configuration, it would reach config.json and the logs) or a variable
    vime sets itself (ENGINE_MANAGED_ENV)."""
    out: dict[str, str] = {}
    for i, entry in enumerate(cfg.vllm_env):
        name, sep, value = entry.partition("=")
        if not sep or not name.isidentifier():  # the entry is not echoed: it may hold a secret's value
            raise ValueError(f"vllm_env entry {i} is not NAME=VALUE (no '=', or no variable name before it)")
        if any(word in name.upper() for word in _SECRET_WORDS):
            raise ValueError(
                f"vllm_env names {name}, which looks like a secret: vllm_env is stored with the run's "
                f"configuration; export {name} in the engine actor's environment instead (engines inherit it)"
            )
        if name in ENGINE_MANAGED_ENV:
            raise ValueError(f"vllm_env sets {name}, which vime sets itself for every engine")
        out[name] = value
    return out


def engine_server_args(cfg: ConfigFields) -> dict:
    """The vLLM server options the configuration implies."""
    vllm_backend = _vllm_backends()[weight_transport(cfg)]
    return {
        "enable_sleep_mode": bool(cfg.offload_rollout),
        "max_model_len": cfg.rollout_max_context_len,
        "tensor_parallel_size": cfg.rollout_num_gpus_per_engine,
        "weight_transfer_config": {"backend": vllm_backend} if vllm_backend else None,
        "logprobs_mode": "processed_logprobs",
        **routing_capture_server_args(cfg),
    }


def routing_capture_server_args(cfg: ConfigFields) -> dict:
    """use_rollout_routing_replay: on CUDA vLLM's own capture (`--enable-return-routed-experts`); on
    the CPU vime's worker extension captures (vllm_side/routing_capture.py), which needs every prompt
    token forwarded: no prefix caching."""
    if not cfg.use_rollout_routing_replay:
        return {}
    if cfg.device == "cpu":
        return {"no_enable_prefix_caching": True}
    return {"enable_return_routed_experts": True}


def _check_routing_replay(cfg: ConfigFields) -> None:
    """The engines' routed experts reach the trainer: on the CPU through the worker extension, which
    reads the router hook of an eager forward (behind vllm-router, each engine is asked for them)."""
    if not cfg.use_rollout_routing_replay or cfg.device != "cpu":
        return
    if not cfg.vllm_enforce_eager:
        raise ValueError(
            "use_rollout_routing_replay=true on device=cpu needs vllm_enforce_eager=true: a compiled engine "
            "forward never calls the router hook that captures the routed experts"
        )
