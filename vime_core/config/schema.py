"""The fields of a vime run's configuration and their constraints, nothing else: slime / verl flag
names, and each field's description is its documentation (`--help`, the Prefect form,
docs/configuration.md). A leaf: VimeConfig (config/loader.py) adds what reaches into the rest of vime."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeFloat

# The package, not algo.registry: importing it registers the built-in estimators.
from vime_core.algo import check_adv_estimator, describe_adv_estimators, registered_adv_estimators

# A registered estimator's name (vime_core/algo/registry.py), checked when the configuration is
# made, so one registered after this import is a valid choice too.
AdvantageEstimator = Annotated[str, AfterValidator(check_adv_estimator)]
LossType = Literal["policy_loss", "sft_loss"]
KLLossType = Literal["k1", "k2", "k3", "low_var_kl"]
RouterPolicy = Literal["round_robin", "random", "consistent_hash", "power_of_two", "cache_aware"]
WeightTransport = Literal["auto", "ipc", "shm", "disk", "nccl", "gloo"]
LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
LRDecayStyle = Literal["constant", "linear", "cosine"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]


def _off_is_none(value: Any) -> Any:
    # `value is False`: YAML 1.1 reads a bare `off` (or `no`, `false`) as False, which as a float
    # would be a bound of 0 that fires on every iteration
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return None
    return value


# A run-guard bound: a number, or `off` (None) for no such check.
OffOrFloat = Annotated[Optional[float], BeforeValidator(_off_is_none)]


def _names_as_list(value: Any) -> Any:
    """A YAML string (PEFT's and TRL's configs write `target_modules: all-linear`, or
    `q_proj,v_proj`) as the list the flag gives; lora.check_lora splits the commas."""
    return value.split() if isinstance(value, str) else value


NameList = Annotated[list[str], BeforeValidator(_names_as_list)]


class ConfigFields(BaseModel):
    """Every setting of a vime run with its default and constraints; the defaults are for real
    models on GPUs (slime's values). Make configurations as `VimeConfig` (vime_core.config),
    which resolves and checks them; this class alone does neither."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)

    # ---- run and storage -------------------------------------------------------------------
    run_name: str = Field(
        "vime-default",
        description=(
            "Name of the run. Actors are detached and namespaced by it; a new flow run with the same name attaches to "
            "them and resumes."
        ),
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$",
    )
    storage_uri: str = Field(
        "runs",
        description=(
            "Where batches, checkpoints and exports go: a local folder or `s3://bucket/prefix` (credentials from the "
            "usual AWS variables/profile, never logged)."
        ),
    )
    storage_endpoint_url: str = Field(
        "",
        validate_default=True,
        description=(
            "Endpoint of the S3 server for an s3:// storage_uri (SeaweedFS, MinIO, ...), e.g. http://127.0.0.1:8333. "
            "Empty: AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, read once when the configuration is made and carried "
            "with it; neither: AWS itself. Credentials are never a setting."
        ),
    )
    storage_region: str = Field(
        "",
        validate_default=True,
        description=(
            "Region of the S3 storage. Empty: AWS_REGION, else AWS_DEFAULT_REGION, read once when the configuration "
            "is made; neither: botocore's default."
        ),
    )
    seed: int = Field(1234, description="Seed for data shuffling, sampling and model initialisation.")
    num_rollout: int = Field(60, ge=1, description="Number of rollout iterations (rollout ids 0 .. num_rollout-1).")
    start_rollout_id: Optional[int] = Field(
        None, ge=0, description="First rollout id; default: the one after the last checkpoint (0 for a new run)."
    )
    save_interval: Optional[int] = Field(
        20,
        ge=1,
        description=(
            "Save a trainer checkpoint every N rollouts (and always after the last one). None: only at the end."
        ),
    )
    save_checkpoints: bool = Field(
        True,
        description=(
            "Save trainer checkpoints (save_interval). --no-save-checkpoints: none at all, e.g. a benchmark of a model "
            "whose optimizer state would fill the disk; a run that fails then starts again from the HF checkpoint."
        ),
    )
    export_hf: bool = Field(
        True,
        description=(
            "After the last iteration, write the trained model as an HF folder (merged weights) under exports/. "
            "--no-export-hf: none, e.g. a LoRA run of a model whose merged copy would fill the disk; with LoRA the "
            "PEFT adapter is exported either way."
        ),
    )
    eval_interval: Optional[int] = Field(None, ge=1, description="Run an eval rollout every N rollouts. None: never.")
    iteration_retries: int = Field(
        2,
        ge=0,
        description=(
            "Times the train flow runs an iteration again after an infrastructure failure (an engine or trainer actor "
            "died, a connection failed: vime_core/faults.py); dead actors are rebuilt first and a rebuilt trainer "
            "retrains the stored batches since its checkpoint. Configuration and data errors are never retried."
        ),
    )
    iteration_retry_delay_s: float = Field(
        5.0, ge=0, description="Seconds before the first retry of a failed iteration; doubled for each further retry."
    )

    # ---- experiment tracking (vime_core/report/tracking.py) --------------------------------------
    use_wandb: bool = Field(
        False,
        description=(
            "Log the resolved configuration once and every iteration's record (the numbers of metrics.jsonl: rewards, "
            "lengths, training metrics, phase times) to Weights & Biases, step = rollout id; a resumed run logs into "
            "the same W&B run. The key comes from WANDB_API_KEY or `wandb login`, never from the configuration."
        ),
    )
    wandb_project: str = Field("vime", description="W&B project.", pattern=r"^[^/\\#?%:]{1,128}$")
    wandb_group: str = Field("", description="W&B run group. Empty: none.")
    wandb_run_name: str = Field(
        "",
        description=(
            "W&B display name. Empty: run_name. The W&B run id is run_name plus a hash of the storage, so the same "
            "run resumes into the same W&B run."
        ),
    )
    wandb_mode: Literal["online", "offline"] = Field(
        "online",
        description=(
            "online: upload as the run goes; offline: write only the local run folder (upload later with `wandb sync`)."
        ),
    )
    wandb_dir: str = Field(
        "",
        description=(
            "Local folder where W&B keeps its files (a wandb/ folder inside it). Empty: the run's report folder "
            "`<storage_uri>/reports/<run_name>` when storage is local, else W&B's default (`./wandb`)."
        ),
    )
    use_tensorboard: bool = Field(
        False,
        description=(
            "Write every iteration's record as TensorBoard scalars (step = rollout id) to "
            "`<storage_uri>/reports/<run_name>/tensorboard`; a resumed run adds an event file there."
        ),
    )

    # ---- model and data ----------------------------------------------------------------------
    hf_checkpoint: str = Field(
        "",
        description=(
            "Hugging Face checkpoint: a local folder (config.json, safetensors, tokenizer) or a hub id "
            "org/name[@revision], downloaded into the HF cache, or taken from it with HF_HUB_OFFLINE=1. Empty: the "
            "embedded demo (a tiny model built under storage_uri, learning addition on the CPU), with its settings "
            "for the fields the configuration does not set (vime_core/demo/settings.py)."
        ),
    )
    prompt_data: str = Field(
        "",
        description=(
            "Prompt dataset, one of: a .jsonl/.json/.parquet file (local path or fsspec URI such as s3://...); a "
            "local folder written by `Dataset.save_to_disk` or holding data files that `datasets.load_dataset` reads; "
            "a hub dataset `namespace/name` or `namespace/name:config` (when no local path of that name exists), "
            "loaded with `datasets.load_dataset`, from the HF datasets cache when HF_HUB_OFFLINE=1. A value "
            "containing :// or ending in .jsonl/.json/.parquet is always a file. Empty: the embedded synthetic task."
        ),
    )
    prompt_data_split: str = Field(
        "train",
        description=(
            "Split read from a dataset folder or hub dataset in prompt_data (a `save_to_disk` folder of one Dataset "
            "has no splits)."
        ),
    )
    input_key: str = Field("prompt", description="Field of a dataset row holding the prompt text.")
    label_key: str = Field(
        "label", description="Field of a dataset row holding the reference answer given to the reward function."
    )
    apply_chat_template: bool = Field(
        False, description="Wrap each prompt in the tokenizer's chat template before tokenising."
    )
    apply_chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Extra keyword arguments for the tokenizer's chat template wherever it is applied (training and eval "
            "prompts), a JSON object, e.g. '{\"enable_thinking\": false}'."
        ),
    )
    drop_bad_prompts: bool = Field(
        False,
        description=(
            "A prompt row whose prompt field is missing, null, empty, not text (or chat messages), or longer than "
            "rollout_max_prompt_len tokens is dropped when the dataset loads and counted (a warning with the count "
            "and the first rows' numbers). False: such a row stops the load with an error naming the file and the row."
        ),
    )
    rollout_shuffle: bool = Field(True, description="Shuffle the prompt dataset each epoch (seeded).")
    eval_prompt_data: str = Field(
        "", description="Eval dataset (same format as prompt_data). Empty: the embedded task's eval split."
    )
    eval_prompt_data_split: Optional[str] = Field(
        None,
        description="Split read from a dataset folder or hub dataset in eval_prompt_data. Default: prompt_data_split.",
    )
    n_samples_per_eval_prompt: int = Field(1, ge=1, description="Samples per eval prompt.")
    eval_temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of eval rollouts (0 = greedy).")

    # ---- placement -----------------------------------------------------------------------------
    colocate: bool = Field(
        True,
        description="Trainer actors and inference engines share the same devices; they take turns (offload/onload).",
    )
    offload_rollout: bool = Field(
        True,
        description="Engines sleep while the trainer runs (vLLM sleep mode; level 2 when they receive weight updates).",
    )
    offload_train: bool = Field(True, description="Trainer frees its device memory while engines generate.")
    offload_train_prepin: bool = Field(
        True,
        description=(
            "With offload_train on a GPU: pin the host memory the trainer's first sleep copies its weights and fp32 "
            "main parameters to while the trainer starts (beside the engines' start), so that sleep, on the way to "
            "the first iteration, only copies (vime_core/trainer/offload.py, prepin_host_memory). False: the first "
            "sleep pins its own."
        ),
    )
    device: Literal["cpu", "cuda"] = Field("cuda", description="Device of trainer actors and engines.")
    actor_num_nodes: int = Field(1, ge=1, description="Nodes of trainer actors.")
    actor_num_gpus_per_node: int = Field(
        1, ge=1, description="Trainer devices per node (on CPU: device slots declared to Ray)."
    )
    tensor_model_parallel_size: int = Field(
        1, ge=1, description="Megatron tensor-parallel size; DP = trainer devices // TP."
    )
    rollout_num_gpus: Optional[int] = Field(
        None, ge=1, description="Devices for inference engines. Default: the trainer's devices when colocated, else 1."
    )
    rollout_num_gpus_per_engine: int = Field(1, ge=1, description="Devices per vLLM engine (its TP size).")
    trainer_node_resource: Optional[str] = Field(
        None,
        description=(
            "A custom Ray resource (declared by `ray start --resources='{\"NAME\": 1}'` on the nodes trainer ranks "
            "may use) that each trainer rank's device bundle asks a share of, so trainer ranks land only on those "
            "nodes. None: any node with devices."
        ),
    )
    engine_node_resource: Optional[str] = Field(
        None,
        description=(
            "The same for the engines' device bundles (with colocate=false: engines on other nodes than the trainer, "
            "e.g. inference nodes). None: any node with devices."
        ),
    )
    ray_address: str = Field(
        "auto", description="Ray cluster address; `auto` attaches to the running local head (infra/ray_head.sh)."
    )
    early_start: bool = Field(
        True,
        description=(
            "`vime train` creates the run's actors, starts the engines and loads the trainer's weights before its "
            "first flow run, while Prefect's temporary server starts; bootstrap then takes them over "
            "(tasks/bootstrap.py). False: bootstrap starts them. A deployment's flow runs always start them in "
            "bootstrap."
        ),
    )
    engine_prestart: bool = Field(
        True,
        description=(
            "Each engine actor launches its vLLM server as soon as it is created, while the RolloutManager that waits "
            "for the engines and watches them is still being made (vLLM's imports and engine-core start then overlap "
            "it). False: the server launches when the RolloutManager starts it."
        ),
    )

    # ---- rollout -------------------------------------------------------------------------------
    rollout_batch_size: int = Field(32, ge=1, description="Prompts (groups) per rollout.")
    n_samples_per_prompt: int = Field(8, ge=1, description="Samples per prompt (the GRPO group size).")
    over_sampling_batch_size: Optional[int] = Field(
        None, ge=1, description="Groups submitted at a time while filling the rollout; default: rollout_batch_size."
    )
    rollout_max_prompt_len: int = Field(
        1024,
        ge=1,
        description=(
            "Longest prompt in tokens: a longer row stops the dataset's load naming the file and row, or is dropped "
            "and counted with drop_bad_prompts."
        ),
    )
    rollout_max_response_len: int = Field(1024, ge=1, description="Maximum generated tokens per sample.")
    rollout_max_context_len: Optional[int] = Field(
        None, ge=2, description="Engine max_model_len. Default: rollout_max_prompt_len + rollout_max_response_len."
    )
    rollout_temperature: float = Field(
        1.0,
        gt=0.0,
        description=(
            "Sampling temperature, > 0: the trainer scores each sampled token under softmax(logits / "
            "rollout_temperature), the distribution the engine sampled from, so 0 (greedy, no distribution to score) "
            "is refused; for greedy evaluation use eval_temperature."
        ),
    )
    rollout_top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description=(
            "Nucleus sampling threshold (1: off): the engine samples from the smallest set of the most probable "
            "tokens (after rollout_top_k) whose probability reaches it, renormalised, and the trainer scores every "
            "log-prob (old, current, reference, teacher) under that same truncated distribution, so the TIS/MIS "
            "weights, the mismatch metrics and use_rollout_logprobs compare like with like; a sampled token the "
            "trainer's logits leave out of the set is added to it."
        ),
    )
    rollout_top_k: int = Field(
        -1,
        ge=-1,
        description=(
            "Top-k sampling (-1 or 0: off): the engine samples from the k most probable tokens, renormalised (then "
            "rollout_top_p over those), and the trainer scores its log-probs under that same truncated distribution."
        ),
    )
    rollout_stop: list[str] = Field(default_factory=list, description="Stop strings.")
    rollout_stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids (EOS always stops).")
    rollout_skip_special_tokens: bool = Field(False, description="Skip special tokens when detokenising responses.")
    vllm_server_concurrency: int = Field(
        512,
        ge=1,
        description="Concurrent requests per engine; the rollout semaphore is this times the number of engines.",
    )
    router_policy: RouterPolicy = Field(
        "consistent_hash",
        description="vllm-router policy; with consistent_hash each sample's session_id goes in x-session-id.",
    )
    use_router: bool = Field(
        True,
        description=(
            "Route generate requests through the real vllm-router (False: the rollout client routes with the same "
            "policy)."
        ),
    )
    rollout_function_path: str = Field(
        "vime_core.rollout.loop:generate_rollout", description="Rollout function, `module:function`."
    )
    custom_generate_function_path: str = Field(
        "",
        description=(
            "Per-sample generate function, `module:function` (multi-turn / tool use). Empty: single-turn "
            "token-in/token-out."
        ),
    )
    rollout_prefetch: bool = Field(
        True,
        description=(
            "Start rollout k+1 as soon as iteration k has synced (in sync's last actor call; after the evaluation "
            "when one is due), so it runs while the checkpoint is saved and Prefect ends flow run k and starts k+1; "
            "same weights, same prompts as without it."
        ),
    )
    async_staleness: int = Field(
        0,
        ge=0,
        le=1,
        description=(
            "1: one step off-policy. Rollout k+1 starts on the weights trained through k-1 right after rollout k, and "
            "generates while the trainer trains on k; every sample is at most this many weight versions behind the "
            "policy it trains (its weight_versions record which). Needs engines that stay awake (CPU, separate GPUs, "
            "or --no-offload-rollout) and --use-tis or --use-rollout-logprobs to correct for the lag. 0: on-policy."
        ),
    )
    rollout_request_max_attempts: int = Field(
        8,
        ge=1,
        description=(
            "Attempts of one generate request whose engine did not answer (dead, restarting, connection reset), with "
            "back-off of 0.5 s doubling up to 5 s; then the sample fails and its group is generated again "
            "(rollout_group_max_attempts)."
        ),
    )
    rollout_group_max_attempts: int = Field(
        3,
        ge=1,
        description=(
            "A group with a sample the engines failed to generate (engine died, connection reset, timeout) is "
            "generated again on a live engine, up to this many attempts in all; then it is dropped and a new prompt "
            "group takes its place."
        ),
    )
    rollout_engine_wait_s: float = Field(
        600.0,
        gt=0,
        description=(
            "After a generate failure, how long the rollout waits for a live engine (a restarting one comes back) "
            "before it fails naming the engines."
        ),
    )
    partial_rollout: bool = Field(
        False,
        description="Aborted samples keep their partial responses and go back to the data source to be continued.",
    )
    dynamic_sampling_filter_path: str = Field(
        "",
        description=(
            "Group filter, `module:function` (e.g. vime_core.rewards.filters:check_reward_nonzero_std). Empty: keep "
            "every group."
        ),
    )
    max_num_gen_batches: int = Field(
        10,
        ge=1,
        description=(
            "Most batches of over_sampling_batch_size groups one rollout submits while the dynamic filter leaves it "
            "short of rollout_batch_size groups (verl's algorithm.filter_groups.max_num_gen_batches, unbounded there "
            "by default); then filter_exhausted decides. Bounded so that data the filter rejects entirely cannot loop "
            "forever. A group the engines failed is not counted: it is generated again alone, or one new group takes "
            "its place (rollout_group_max_attempts)."
        ),
    )
    filter_exhausted: Literal["fail", "keep_rejected"] = Field(
        "fail",
        description=(
            "What a rollout does when max_num_gen_batches batches left it short of rollout_batch_size kept groups: "
            "fail: the iteration fails with one line naming the filter and the counts (never retried: data or filter, "
            "not infrastructure); keep_rejected: it trains on what it has, the kept groups topped up with groups the "
            "filter rejected (their advantages are 0 when every reward of the group is equal), counted as "
            "rollout/filter_topped_up."
        ),
    )

    # ---- reward --------------------------------------------------------------------------------
    rm_type: str = Field(
        "arith",
        description=(
            "Built-in reward (vime_core/builtin_rewards.py): math (boxed/final-number checker), exact_match, f1, "
            "arith (the demo task's), remote_rm. Anything else is refused unless custom_rm_path is set."
        ),
    )
    custom_rm_path: str = Field(
        "",
        description=(
            "Reward function `module:function` (sync or async; per sample, or per group with group_rm). Overrides "
            "rm_type."
        ),
    )
    group_rm: bool = Field(False, description="Score each group at once instead of each sample.")
    rm_url: str = Field("", description="Remote reward model endpoint for rm_type=remote_rm.")
    max_reward_failure_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Largest share of a rollout's samples whose reward function raised or returned something that is not a "
            "real number (such samples are FAILED: loss mask 0, no gradient); above it the iteration fails with one "
            "line naming the reward function (never retried). 1: never fail on reward failures (they are still logged "
            "once per rollout and counted as rollout/reward_failed_count and rollout/failed_count)."
        ),
    )
    rm_timeout_s: float = Field(30.0, gt=0, description="Timeout of one remote reward call.")
    rm_api_key_env: str = Field(
        "VIME_RM_API_KEY",
        description=(
            "Name of the environment variable holding the remote reward model's bearer token (never the token "
            "itself), read once where the RolloutManager runs (it must be set in the environment the Ray node started "
            "with) when its rewards are built. Unset default variable: no Authorization header; any other name that "
            "is unset fails at start. Empty: no token from the environment."
        ),
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$|^$",
    )
    rm_api_key_file: str = Field(
        "",
        description=(
            "Path of a file holding the remote reward model's bearer token (never the token itself), read once on the "
            "RolloutManager's node when its rewards are built (e.g. a mounted secret; it can be written after the Ray "
            "node started). A missing or empty file fails at start. Overrides rm_api_key_env."
        ),
    )
    overlong_buffer_enable: bool = Field(
        False,
        description=(
            "DAPO's soft overlong punishment (Yu et al. 2025): add to a sample's reward, before the group "
            "normalisation, 0 when its response has at most L_max - L_cache tokens, falling linearly to "
            "-overlong_buffer_penalty_factor at L_max, and -overlong_buffer_penalty_factor beyond; L_max = "
            "rollout_max_response_len, L_cache = overlong_buffer_len (verl's "
            "reward_model.reward_kwargs.overlong_buffer_cfg.enable). Formula: vime_core/algo/shaping.py."
        ),
    )
    overlong_buffer_len: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "L_cache of overlong_buffer_enable: the last tokens of rollout_max_response_len over which the penalty "
            "grows; at most rollout_max_response_len. DAPO uses 4096 of 20480 (verl's overlong_buffer_cfg.len)."
        ),
    )
    overlong_buffer_penalty_factor: float = Field(
        1.0,
        ge=0,
        description=(
            "The penalty of overlong_buffer_enable at L_max and beyond (the paper's 1) (verl's "
            "overlong_buffer_cfg.penalty_factor)."
        ),
    )

    # ---- engines -------------------------------------------------------------------------------
    vllm_python: str = Field(
        ".venv-vllm/bin/python",
        description="Python interpreter of the vLLM environment; the engine actor starts the server with it.",
    )
    vllm_cpu_kvcache_gb: float = Field(1.0, gt=0, description="KV cache GiB per CPU engine (VLLM_CPU_KVCACHE_SPACE).")
    vllm_gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vLLM GPU memory fraction when colocated on GPUs."
    )
    vllm_enforce_eager: Optional[bool] = Field(
        None,
        description=(
            "Start engines without compilation/CUDA graphs: a faster start, less generation throughput. Default: true "
            "on CPU, false on CUDA."
        ),
    )
    vllm_cpu_single_process: bool = Field(
        True,
        description=(
            "On CPU, a one-rank engine runs its model worker inside vLLM's engine-core process (vLLM's uni executor, "
            "as one-rank GPU engines do), forked from the API server rather than spawned, pinned to the engine's "
            "cores with one thread per core: each start imports vLLM and torch twice less. False: vLLM's CPU "
            "default, a spawned engine core and a worker process beside it with its threads bound to the engine's "
            "cores. No effect on CUDA or with rollout_num_gpus_per_engine > 1."
        ),
    )
    vllm_api_server_count: int = Field(
        1,
        ge=1,
        le=64,
        description=(
            "HTTP front-end processes of each vLLM server (`vllm serve --api-server-count`), sharing its engine: a "
            "front end builds every response in Python on one core, and per-token log-probs make that the rollout's "
            "bottleneck on a fast GPU. 1: vLLM's single-process server."
        ),
    )
    vllm_log_stats: bool = Field(
        False,
        description=(
            "Keep vLLM's own statistics (its periodic throughput log lines and Prometheus /metrics). Off by default, "
            "as verl starts its engines: the front end updates them for every generated token, CPU the rollout needs "
            "(vime records its own throughput per iteration). Off = `vllm serve --disable-log-stats`."
        ),
    )
    vllm_extra_args: list[str] = Field(default_factory=list, description="Extra arguments for the vLLM server.")
    vllm_env: list[str] = Field(
        default_factory=list,
        description=(
            "Environment of the vLLM servers on top of their actor's, as NAME=VALUE entries, e.g. "
            "VLLM_WORKER_MULTIPROC_METHOD=fork on CUDA (vLLM's engine core forked from its front end instead of "
            "spawned: no second import of vLLM; vLLM's CPU build ignores it, and vime forks a one-rank CPU engine's "
            "itself: vllm_cpu_single_process). Stored with the run's configuration, so a secret is refused here: it "
            "reaches the engines through the actor's own environment, which they inherit. Names vime sets itself "
            "(ENGINE_MANAGED_ENV, config/derive.py) are refused too."
        ),
    )
    vllm_cache_uri: str = Field(
        "",
        description=(
            "Where engines keep vLLM's cache between hosts (torch.compile's artifacts, what vLLM learned inspecting "
            "the model): a folder or s3://bucket/prefix, one archive per cache entry there. An engine unpacks the "
            "entries its host lacks before it starts, and once it serves stores the entries its start added to, so "
            "a fresh host skips what an earlier start did (vime_core/engines/vllm_cache.py). "
            "Empty: each host's own cache only."
        ),
    )
    engine_urls: list[str] = Field(
        default_factory=list,
        description=(
            "Attach to external vLLM servers at these URLs instead of starting engines. vime sends them "
            "`Authorization: Bearer $VIME_ENGINE_TOKEN` when that variable is set where the run starts (the token "
            "vime's middleware reads; docs/gpus-and-clusters.md), else no token: their security is the user's."
        ),
    )
    engine_bind_host: str = Field(
        "127.0.0.1",
        description=(
            "Address the engines' vLLM servers bind to. Loopback (the default) keeps them private to one machine; "
            "0.0.0.0 (or a node address) lets trainer ranks and the router on other Ray nodes reach them (a wildcard "
            "bind is advertised as the node's Ray address)."
        ),
    )
    engine_auth: bool = Field(
        True,
        description=(
            "Every route of every engine vime starts (generate, /health, /collective_rpc, /sleep, /wake_up, /pause, "
            "the weight-update session, ...) asks for the run's token, `Authorization: Bearer <token>`: made once per "
            "run at start, handed to the run's actors through Ray, never written to a file "
            "(docs/gpus-and-clusters.md). With use_router, GET /health stays open for vllm-router's health checks. "
            "false: no authentication, refused with an engine_bind_host beyond loopback unless "
            "allow_unauthenticated_engines."
        ),
    )
    allow_unauthenticated_engines: bool = Field(
        False,
        description=(
            "Let engine_auth=false engines bind beyond loopback (engine_bind_host): anyone who reaches an engine's "
            "port can then generate, pause it, load weights into it (/collective_rpc) and send it pickled payloads; a "
            "warning at start says so. For a network you control end to end."
        ),
    )
    check_weight_transfer: bool = Field(
        True,
        description=(
            "Check every weight bucket's bytes on arrival: the trainer sends an integer checksum of each tensor as it "
            "packed it, each engine worker sums what it received and refuses a bucket that differs before loading any "
            "of it (the publish fails and is retried). Exact, unlike the log-prob probe of check_weight_update_equal. "
            "For the shm, nccl and gloo transports (ipc hands the trainer's own memory to the engine; disk goes "
            "through safetensors); costs one more read of the bytes on each side."
        ),
    )
    check_weight_update_equal: bool = Field(
        False,
        description=(
            "After every publish, compare the engines' log-probs of a fixed probe sequence with the trainer's (max "
            "|diff| recorded in the iteration record, with the change from the previous version); as slime's "
            "--check-weight-update-equal. An engine that scores the probe exactly as before while the trainer's "
            "log-probs moved did not receive the publish: the iteration fails and its retry publishes again. Costs "
            "one short forward on each side."
        ),
    )
    engine_startup_timeout_s: float = Field(
        600.0, gt=0, description="Seconds to wait for an engine's health before failing with its log."
    )

    # ---- algorithm -----------------------------------------------------------------------------
    advantage_estimator: AdvantageEstimator = Field(
        "grpo",
        description=(
            f"One of the registered advantage estimators (vime_core.algo.register_adv_est): "
            f"{describe_adv_estimators()}."
        ),
        json_schema_extra=lambda schema: schema.update(enum=registered_adv_estimators()),
    )
    grpo_std_normalization: bool = Field(
        True, description="Divide group-centred rewards by the group's unbiased std + 1e-6 (Dr. GRPO turns this off)."
    )
    loss_type: LossType = Field("policy_loss", description="policy_loss (PPO-clip family) or sft_loss.")
    loss_agg_mode: LossAggregation = Field(
        "token_mean",
        description=(
            "Aggregation over loss_mask==1 tokens: token_mean (per token), seq_mean_token_mean / seq_mean_token_sum "
            "(per sequence), seq_mean_token_sum_norm (each sequence's token sum divided by the constant "
            "loss_scale_factor, then the mean over sequences: Dr. GRPO's length-unbiased loss, Liu et al. 2025, with "
            "grpo_std_normalization=false; verl's seq-mean-token-sum-norm)."
        ),
    )
    loss_scale_factor: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "The constant L of loss_agg_mode=seq_mean_token_sum_norm: loss = mean_i(sum_t m_{i,t} l_{i,t}) / L "
            "(verl's actor.loss_scale_factor). Default: rollout_max_response_len (Dr. GRPO's generation budget)."
        ),
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range below 1 (ratio >= 1 - eps_clip).")
    eps_clip_high: Optional[float] = Field(
        None,
        gt=0,
        description="PPO clip range above 1 (ratio <= 1 + eps_clip_high). Default: eps_clip. DAPO uses 0.28.",
    )
    eps_clip_c: Optional[float] = Field(
        None, gt=1.0, description="Dual-clip bound for negative advantages (Ye et al. 2020); must be > 1. None: off."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the KL-to-reference penalty in the token rewards, r_t = -kl_coef * kl_t + [t = T-1] * reward "
            "(reinforce_plus_plus, reinforce_plus_plus_baseline; slime's --kl-coef). grpo, gspo and cispo have no "
            "token rewards and refuse it: use use_kl_loss."
        ),
    )
    use_kl_loss: bool = Field(
        False,
        description=(
            "Add kl_loss_coef * KL(policy || reference) to the loss (slime's --use-kl-loss); the KL is also reported "
            "as 'kl'."
        ),
    )
    kl_loss_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the KL loss term when use_kl_loss: loss + kl_loss_coef * agg(token KL), aggregated like "
            "the policy loss (loss_agg_mode) (slime's --kl-loss-coef)."
        ),
    )
    kl_loss_type: KLLossType = Field(
        "low_var_kl", description="KL estimator of both KL terms: k1, k2, k3 or low_var_kl (k3 clamped to [-10, 10])."
    )
    ref_load: Optional[str] = Field(
        None,
        description=(
            "HF checkpoint folder of the reference policy of the KL terms, same architecture as hf_checkpoint. "
            "Default: hf_checkpoint (the starting weights)."
        ),
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description=(
            "Entropy bonus weight: loss - entropy_coef * agg(token entropy), aggregated like the policy loss "
            "(loss_agg_mode); 0 is the usual GRPO."
        ),
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of REINFORCE++ returns and GAE.")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    use_rollout_logprobs: bool = Field(
        False, description="Use the engine's log-probs as the old policy instead of recomputing them."
    )
    use_tis: bool = Field(
        False,
        description=(
            "Weight the policy loss by the train/rollout mismatch, w = pi_old / pi_rollout per token, at tis_level "
            "and bounded by tis_mode (slime's --use-tis; truncated importance sampling, Yao et al. 2025). Formulas: "
            "vime_core/algo/losses.py (rollout_is_weights)."
        ),
    )
    tis_clip: float = Field(
        2.0,
        gt=0,
        description=(
            "Upper bound C of the use_tis weight: truncate keeps min(w, C), mask rejects w > C (slime's --tis-clip; "
            "verl's algorithm.rollout_correction.rollout_is_threshold)."
        ),
    )
    tis_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description=(
            "Level of the use_tis weight (slime's --tis-level): token: each token's own ratio (TIS); sequence: the "
            "product of the sample's token ratios, one weight for all its tokens (verl's rollout_is=sequence); "
            "geometric: their geometric mean (length-normalised). Log-ratios bounded to +-20, as slime and verl."
        ),
    )
    tis_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description=(
            "How use_tis bounds its weight (slime's --tis-mode): truncate: min(w, tis_clip) (TIS); mask: w when "
            "tis_clip_low <= w <= tis_clip, else 0 (MIS, Liu et al. 2025; at sequence or geometric level the whole "
            "sample; verl's rollout_rs rejection). A rejected token adds 0 to the loss and still counts in its "
            "denominator, as in slime; verl drops rejected tokens from its response_mask, so from the mean."
        ),
    )
    tis_clip_low: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Lower bound c of tis_mode=mask: w < c is rejected (slime's --tis-clip-low, its MIS tis_lower_bound; "
            "verl's lower bound in rollout_rs_threshold). Default: 1 / tis_clip."
        ),
    )
    get_mismatch_metrics: bool = Field(
        False, description="Report train-vs-rollout log-prob mismatch metrics (forces a log-prob recompute)."
    )

    # ---- critic (advantage_estimator=ppo; vime_core/trainer/critic.py) ----------------------------
    critic_load: Optional[str] = Field(
        None,
        description=(
            "HF checkpoint folder the critic's body starts from (a causal LM of a supported architecture with "
            "hf_checkpoint's vocabulary; its LM head is not used); the scalar value head (hidden -> 1) starts at "
            "zero. Default: hf_checkpoint. A resumed run takes the critic from the trainer checkpoint instead "
            "(slime's --critic-load)."
        ),
    )
    critic_save: Optional[str] = Field(
        None,
        description=(
            "Where the critic's checkpoint files go: a local folder or s3:// URI (the run's S3 endpoint), each "
            "checkpoint's `critic_rank_<r>.pt` written under `<critic_save>/<run_name>/rollout_<k:06d>/`. The "
            "checkpoint's manifest records the folder and a resumed run loads the critic from it. Default: beside the "
            "policy's rank files in the trainer checkpoint (slime's --critic-save)."
        ),
    )
    critic_lr: Optional[float] = Field(
        None,
        gt=0,
        description=(
            "Adam learning rate of the critic, under the same schedule settings as lr (lr_decay_style, min_lr, ...). "
            "Default: lr (slime's --critic-lr)."
        ),
    )
    critic_lr_warmup_iters: int = Field(
        0,
        ge=0,
        description=(
            "Optimizer steps of the critic's linear warmup from lr_warmup_init to critic_lr. Default 0: none (slime's "
            "--critic-lr-warmup-iters)."
        ),
    )
    num_critic_only_steps: int = Field(
        0,
        ge=0,
        description=(
            "Rollouts, from rollout id 0, that train the critic only: the policy is not updated until the value head "
            "has learnt something (slime's --num-critic-only-steps)."
        ),
    )
    value_clip: float = Field(
        0.2,
        gt=0,
        description=(
            "Clip range of the value loss: the critic's value of a token moves at most this far from its value at "
            "rollout time, 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -value_clip, value_clip) - R)^2) (slime's "
            "--value-clip). Formula: vime_core/algo/value_loss.py."
        ),
    )

    # ---- on-policy distillation (slime's --use-opd family) ------------------------------------
    use_opd: bool = Field(
        False,
        description=(
            "On-policy distillation (slime's --use-opd; Agarwal et al. 2024, Thinking Machines 2025): a frozen "
            "teacher scores the student's own samples and each token's advantage becomes A_t - opd_kl_coef * (log "
            "pi_student(y_t) - log pi_teacher(y_t)), on top of any advantage_estimator (with a reward of 0 the "
            "teacher is the only signal). pi_student is the old policy of the loss. Reported as opd_reverse_kl. "
            "Formula: vime_core/algo/advantages.py (apply_opd_kl)."
        ),
    )
    opd_type: Optional[Literal["megatron"]] = Field(
        None,
        description=(
            "Where the teacher runs (slime's --opd-type), required with use_opd: megatron, a second frozen model in "
            "the trainer loaded from opd_teacher_load, forwarded over each rollout beside the reference. (slime's "
            "sglang, a teacher on an external server queried during the rollout, is not provided.)"
        ),
    )
    opd_kl_coef: float = Field(
        1.0,
        ge=0,
        description="Weight of the teacher's reverse-KL signal in the advantages when use_opd (slime's --opd-kl-coef).",
    )
    opd_teacher_load: Optional[str] = Field(
        None,
        description=(
            "HF checkpoint of the teacher when opd_type=megatron (slime's --opd-teacher-load, a Megatron checkpoint "
            "there): a local folder or hub id as hf_checkpoint. Any architecture the trainer builds, with the "
            "student's vocabulary: its config.json vocab_size and its tokenizer's vocabulary must equal the student's "
            "(checked when the trainer loads it)."
        ),
    )

    # ---- training ------------------------------------------------------------------------------
    num_steps_per_rollout: Optional[int] = Field(
        1, ge=1, description="Optimizer steps per rollout; sets global_batch_size."
    )
    global_batch_size: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Samples per optimizer step. Default: rollout_batch_size * n_samples_per_prompt // num_steps_per_rollout."
        ),
    )
    micro_batch_size: int = Field(
        1, ge=1, description="Samples per micro-batch per DP rank (when not packing by tokens)."
    )
    use_dynamic_batch_size: bool = Field(
        False, description="Pack micro-batches by a token budget (max_tokens_per_gpu) instead of a fixed sample count."
    )
    max_tokens_per_gpu: Optional[int] = Field(
        None, ge=1, description="Token budget of one packed micro-batch (with use_dynamic_batch_size)."
    )
    lr: float = Field(
        1e-6,
        gt=0,
        description=(
            "Adam learning rate; under a schedule its peak: warmup rises to it, decay falls from it to min_lr "
            "(Megatron/slime --lr)."
        ),
    )
    lr_decay_style: LRDecayStyle = Field(
        "constant",
        description=(
            "Learning-rate schedule after warmup, applied by Megatron's OptimizerParamScheduler once per optimizer "
            "step: constant (lr), linear or cosine (from lr down to min_lr over lr_decay_iters). Default constant, as "
            "slime's example scripts set (Megatron's own default is linear) (Megatron/slime --lr-decay-style)."
        ),
    )
    lr_decay_iters: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "Optimizer steps over which the learning rate decays to min_lr (warmup included); min_lr afterwards. "
            "Default: the policy's optimizer steps, (num_rollout - num_critic_only_steps) * num_steps_per_rollout "
            "(Megatron/slime --lr-decay-iters); the critic's schedule decays over this plus its critic-only steps."
        ),
    )
    lr_warmup_iters: int = Field(
        0,
        ge=0,
        description=(
            "Optimizer steps of linear warmup from lr_warmup_init to lr; must be fewer than lr_decay_iters. Default "
            "0: no warmup (Megatron/slime --lr-warmup-iters)."
        ),
    )
    lr_warmup_fraction: Optional[float] = Field(
        None,
        ge=0,
        le=1,
        description=(
            "Warmup as a fraction of lr_decay_iters, instead of lr_warmup_iters (set only one). Default None: "
            "lr_warmup_iters applies (Megatron/slime --lr-warmup-fraction)."
        ),
    )
    lr_warmup_init: float = Field(
        0.0,
        ge=0,
        description=(
            "Learning rate of the first warmup step; warmup rises linearly from it to lr. Default 0.0 (Megatron/slime "
            "--lr-warmup-init)."
        ),
    )
    min_lr: float = Field(
        0.0,
        ge=0,
        description=(
            "Learning rate at the end of a linear or cosine decay, kept after lr_decay_iters; at most lr. Default 0.0 "
            "(Megatron/slime --min-lr)."
        ),
    )
    weight_decay: float = Field(
        0.0,
        ge=0,
        description=(
            "AdamW (decoupled) weight decay; not applied to biases and 1-D parameters such as norms, as in Megatron. "
            "Default 0.0 (Megatron/slime --weight-decay)."
        ),
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="Adam beta1 (Megatron/slime --adam-beta1).")
    adam_beta2: float = Field(
        0.98,
        ge=0,
        lt=1,
        description=(
            "Adam beta2. Default 0.98, as slime's example scripts set (Megatron's own default is 0.999) "
            "(Megatron/slime --adam-beta2)."
        ),
    )
    adam_eps: float = Field(
        1e-8, gt=0, description="Adam epsilon, added to the denominator. Default 1e-8 (Megatron/slime --adam-eps)."
    )
    max_skipped_steps: int = Field(
        3,
        ge=0,
        description=(
            "An optimizer step whose loss or gradient is not finite (NaN or Inf on any rank, checked with one "
            "all-reduce) is skipped: no weight moves, the gradient is dropped, and it is counted as skipped_steps in "
            "the iteration record and on its console line (critic_skipped_steps for the critic's). After this many "
            "skipped steps in a row the run stops with one line naming the rollout id; weights, checkpoints and "
            "stored batches from before stay as they were. 0: stop at the first."
        ),
    )
    clip_grad: float = Field(
        1.0,
        ge=0,
        description="Clip the global gradient norm to this value (0: off). Default 1.0 (Megatron/slime --clip-grad).",
    )
    bf16: bool = Field(False, description="Train in bf16 (GPUs); fp32 otherwise.")
    recompute_granularity: Optional[RecomputeGranularity] = Field(
        None,
        description=(
            "Activation recompute (GPU only): full recomputes whole transformer layers in the backward pass, "
            "selective only their core attention. Default None: keep all activations (Megatron/slime "
            "--recompute-granularity)."
        ),
    )
    recompute_method: Optional[RecomputeMethod] = Field(
        None,
        description=(
            "With recompute_granularity=full: uniform recomputes every layer in units of recompute_num_layers, block "
            "only the first recompute_num_layers layers. Default: uniform when full (Megatron/slime "
            "--recompute-method)."
        ),
    )
    recompute_num_layers: Optional[int] = Field(
        None,
        ge=1,
        description=(
            "With recompute_granularity=full: layers per recompute unit (uniform) or layers recomputed (block). "
            "Default: 1 when full (Megatron/slime --recompute-num-layers)."
        ),
    )
    rope_fusion: bool = Field(
        True,
        description=(
            "On GPUs: RoPE in one compiled kernel per query/key tensor, its cos/sin built once per micro-batch "
            "(Megatron's apply_rope_fusion, filled by vime without Transformer Engine). --no-rope-fusion runs "
            "Megatron's unfused RoPE (Megatron/slime --no-rope-fusion)."
        ),
    )
    bias_swiglu_fusion: bool = Field(
        True,
        description=(
            "On GPUs: the MLP's SwiGLU as Megatron's torch.compile'd kernel, forward and backward (Megatron's "
            "bias_activation_fusion). --no-bias-swiglu-fusion runs it unfused (Megatron/slime "
            "--no-bias-swiglu-fusion)."
        ),
    )
    use_distributed_optimizer: bool = Field(
        False,
        description=(
            "Shard Adam's state and fp32 main parameters over the data-parallel ranks (GPU only; ZeRO-1 style, "
            "Megatron's DistributedOptimizer). Default False (Megatron/slime --use-distributed-optimizer)."
        ),
    )
    update_weight_buffer_size: int = Field(512 * 1024**2, ge=1024, description="Bytes per weight-update bucket.")
    weight_transport: WeightTransport = Field(
        "auto",
        description=(
            "How published weights reach the engines. auto picks by placement: ipc (CUDA engines on the trainer's "
            "GPUs), nccl (CUDA engines on other GPUs or nodes), shm (CPU engines on the trainer's machine). gloo: CPU "
            "engines on other machines; disk: safetensors files the engines reload (needs a path both sides see)."
        ),
    )
    flush_cache_interval: int = Field(
        1,
        ge=1,
        description=(
            "Flush engines' prefix cache (and abort in-flight requests) every N weight versions; the first publish "
            "always flushes."
        ),
    )

    # ---- run guard (vime_core/report/guard.py) ------------------------------------------------
    guard_nonfinite: bool = Field(
        True,
        description=(
            "Run guard: stop when a guarded metric of the iteration (reward mean and std, response length, grad "
            "norm; entropy, losses and the k3 mismatch when no optimizer step was skipped) is NaN or Inf. `off`: "
            "no such check (skipped optimizer steps are max_skipped_steps' own)."
        ),
    )
    guard_grad_norm_factor: OffOrFloat = Field(
        50.0,
        gt=0,
        description=(
            "Run guard: stop when grad_norm exceeds this many times its running median (over guard_window accepted "
            "iterations, after guard_warmup of them) and clip_grad too (a norm the clip leaves alone is an ordinary "
            "step, however small the median). `off`: no such check."
        ),
    )
    guard_entropy_min: OffOrFloat = Field(
        0.005,
        ge=0,
        description="Run guard: stop when the policy's token entropy falls below this floor (nats). `off`: no floor.",
    )
    guard_entropy_drop: OffOrFloat = Field(
        0.75,
        gt=0,
        le=1,
        description=(
            "Run guard: stop when the entropy falls by more than this share of its previous iteration's value in one "
            "iteration. `off`: no such check."
        ),
    )
    guard_k3_max: OffOrFloat = Field(
        0.05,
        ge=0,
        description=(
            "Run guard: stop when the train/rollout log-prob mismatch, KL(engine || trainer) estimated by k3 over the "
            "sampled tokens (train_rollout_k3_kl), exceeds this (nats per token): the engines sample from another "
            "policy than the trainer scores. Not applied with async_staleness > 0, where the trainer has moved "
            "past the weights the engines sampled with by design. `off`: no such check."
        ),
    )
    guard_reward_failure_share: OffOrFloat = Field(
        0.1,
        ge=0,
        le=1,
        description=(
            "Run guard: stop when more than this share of the rollout's reward calls failed (reward_failure_share; "
            "max_reward_failure_share is the rollout's own, harder bound). `off`: no such check."
        ),
    )
    guard_aborted_share: OffOrFloat = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Run guard: stop when more than this share of the samples a rollout submitted were aborted "
            "(aborted_count over submitted_groups x n_samples_per_prompt; raise it with heavy over-sampling). `off`: "
            "no such check."
        ),
    )
    guard_reward_drop: OffOrFloat = Field(
        0.5,
        gt=0,
        description=(
            "Run guard: stop when reward_mean falls below its running median by more than this share of "
            "max(|median|, the median reward std) (after guard_warmup accepted iterations). `off`: no such check."
        ),
    )
    guard_window: int = Field(20, ge=1, description="Run guard: accepted iterations the running medians cover.")
    guard_warmup: int = Field(
        5, ge=1, description="Run guard: accepted iterations before the checks against a running median apply."
    )
    guard_action: Literal["stop", "rollback"] = Field(
        "stop",
        description=(
            "Run guard: what a breach does. Either way the iteration's flow run fails with one line naming the check, "
            "before its publish and checkpoint; the iteration's batch is quarantined (kept, unpublished) and the data "
            "source goes back before it. stop: the run stops, the engines and the checkpoints keeping the last good "
            "weights (the same command resumes). rollback: the trainer returns to the last good weights (rebuilt from "
            "its last checkpoint, the stored batches since trained again, each publish checked), and the iteration "
            "is run again on the same prompts with new samples, up to guard_retries times; then the run stops."
        ),
    )
    guard_retries: int = Field(
        2, ge=0, description="Run guard: with guard_action rollback, how many times one iteration is run again."
    )
    # ---- LoRA (vime_core/trainer/lora.py; checks in vime_core/config/lora.py) ----------------------
    lora_rank: int = Field(
        0,
        description=(
            "Rank r of the LoRA adapters on the linear layers of target_modules; 0 trains the full weights. With LoRA "
            "the base weights are frozen, only the adapters are in the optimizer, and the KL terms' reference is the "
            "same model with its adapters switched off (no second copy). As verl's --lora-rank / PEFT's r."
        ),
    )
    lora_alpha: float = Field(
        16.0,
        gt=0,
        description="LoRA scaling numerator: the adapter adds (lora_alpha / lora_rank) * B A x (PEFT's lora_alpha).",
    )
    lora_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input while training (PEFT's lora_dropout); the base path has none.",
    )
    target_modules: NameList = Field(
        default_factory=lambda: ["all-linear"],
        description=(
            "Linear layers that get adapters, by their HF names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj (space- or comma-separated), or all-linear for all of them (PEFT's target_modules). Megatron "
            "fuses q/k/v in one layer and gate/up in another, so those come in groups."
        ),
    )
    lora_publish: Literal["merged", "adapter"] = Field(
        "merged",
        description=(
            "What a publish sends to the engines with LoRA: merged sends W + (lora_alpha / lora_rank) B A under the "
            "HF names through the usual transports (any engine, the full weights' bytes); adapter sends only the "
            "adapter (PEFT-named A and B) to engines started with vLLM's LoRA support, which serve the frozen base "
            "weights and name the adapter of each version in their requests (vime-lora-v<version>)."
        ),
    )

    # ---- mixture of experts (Qwen3-MoE; vime_core/trainer/model.py moe_settings) ----------------
    expert_model_parallel_size: int = Field(
        1,
        ge=1,
        description=(
            "Megatron's expert-parallel size (slime's --expert-model-parallel-size): the experts of each MoE layer "
            "are split over this many data-parallel ranks (each holds num_experts / EP whole experts, each split "
            "over the TP ranks like a dense MLP: expert TP = TP). Must divide the data-parallel size and the "
            "model's num_experts; 1: every rank holds all experts."
        ),
    )

    moe_grouped_gemm: bool = Field(
        True,
        description=(
            "Each MoE layer's local experts as two grouped GEMMs (torch._grouped_mm, one launch for all experts; "
            "vime_core/trainer/grouped_experts.py) where the host runs them (the CPU, CUDA from Hopper on), else "
            "one MLP per expert in turn (Megatron's SequentialMLP). The weights are the same tensors either way; "
            "grouped keeps a stacked copy of each layer's expert weights until the backward. --no-moe-grouped-gemm: "
            "always one MLP per expert (Megatron/slime --moe-grouped-gemm)."
        ),
    )

    # ---- MoE router losses (vime_core/trainer/model.py router_loss_settings; moe_metrics.py) ----------
    moe_aux_loss_coeff: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the router's load-balancing loss in the policy's training loss (Megatron's and slime's "
            "--moe-aux-loss-coeff; 1e-3 is the common pre-training value). Default 0.0, not the checkpoint's "
            "router_aux_loss_coef: transformers adds that only with output_router_logits=true (false in the "
            "released Qwen3-MoE configs), slime's RL recipes set 0, and a fixed default means the same run on every "
            "checkpoint. Any value > 0 logs moe_aux_loss per iteration; a dense model refuses it at trainer start."
        ),
    )
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = Field(
        "aux_loss",
        description=(
            "Megatron's --moe-router-load-balancing-type: aux_loss is the Switch Transformer loss "
            "E * sum_i f_i * P_i over each micro-batch's tokens (f_i the share of routed slots to expert i, P_i "
            "its mean router probability); seq_aux_loss Megatron's per-sequence variant, which here equals aux_loss: "
            "the trainer packs a micro-batch's samples into one sequence (micro_batch_size=1 makes both per "
            "sample); none: no load-balancing loss (moe_aux_loss_coeff must then be 0). A dense model refuses "
            "anything but the default."
        ),
    )
    moe_z_loss_coeff: float = Field(
        0.0,
        ge=0,
        description=(
            "Weight of the router's z-loss, mean over tokens of logsumexp(router logits)^2 (ST-MoE; Megatron's "
            "--moe-z-loss-coeff); 0 turns it off. Any value > 0 logs moe_z_loss per iteration; a dense model "
            "refuses it at trainer start."
        ),
    )

    # ---- routing replay (vime_core/trainer/routing_replay.py; docs/design/routing_replay.md) ----------
    use_rollout_routing_replay: bool = Field(
        False,
        description=(
            "Routing replay (slime's --use-rollout-routing-replay, R3): the trainer's MoE layers route each token "
            "to the experts the engine chose for it, so the policy's and the reference's log-probs are computed "
            "with the engine's routing (the router still gets gradients through the chosen experts' "
            "probabilities). The engines return the experts (on CUDA vLLM's --enable-return-routed-experts; on the "
            "CPU vime's worker extension, which needs vllm_enforce_eager=true and starts the "
            "engines without prefix caching) into the batch's routed_experts column. A dense model refuses it at "
            "trainer start."
        ),
    )

    # ---- storage retries (tasks/rollout.py persist; vime_core/storage/fs.py) ----------------------
    persist_retry_delays_s: list[NonNegativeFloat] = Field(
        default_factory=lambda: [2.0, 5.0, 10.0],
        description=(
            "Seconds the persist task waits before each of its retries, one retry per value ([] for none): a batch "
            "write that failed on the object store (down, restarting, unreachable) is tried again after each, so a "
            "short outage is ridden out; once every try failed, the iteration fails."
        ),
    )
    storage_request_retries: Optional[int] = Field(
        None,
        ge=0,
        description=(
            "Retries of each S3 request within one storage call (botocore's retries max_attempts) before the call "
            "fails and the task's own retries take over. None: botocore's own count (AWS_MAX_ATTEMPTS or the AWS "
            "profile's max_attempts; else 4 retries in its legacy mode)."
        ),
    )
