"""`MegatronTrainer`: one trainer rank (a plain class; the cluster module makes it a Ray actor).
`init(hf_checkpoint)` builds the Megatron model, DDP, optimizer and schedule (the critic with ppo;
with lora_rank, LoRA adapters on a frozen base: trainer/lora.py); then `train` per rollout, `publish`
per sync, `save` / `load` / `export_hf`, `sleep` / `wake` between phases, `close`. Every method runs
on every rank at once, except `state`."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator, Optional

import torch

from vime_core.algo.gates import needs_critic, needs_reference, needs_teacher
from vime_core.config import VimeConfig, weight_transport
from vime_core.config.lora import lora_enabled
from vime_core.engines.adapters import serves_adapters
from vime_core.engines.auth import EngineToken
from vime_core.storage.endpoint import S3Endpoint
from vime_core.trainer import checkpoint as ckpt
from vime_core.trainer.compat_cpu import seed_everything
from vime_core.trainer.critic import Critic
from vime_core.trainer.hf_convert import iter_hf_weights, load_hf_into_model
from vime_core.trainer.hf_export import write_hf_folder
from vime_core.trainer.lora import (
    apply_lora,
    check_lora_state,
    checkpoint_model_state,
    load_model_state,
    lora_hf_state,
    lora_settings,
)
from vime_core.trainer.model import (
    architecture_from_hf,
    build_gpt_model,
    check_router_losses,
    check_ep_divides,
    check_routing_replay,
    grouped_experts,
    fusion_settings,
    read_hf_config,
    recompute_settings,
    router_loss_settings,
)
from vime_core.trainer.nonfinite import NonFiniteStepsError, SkipCounter
from vime_core.trainer.offload import (
    device_memory,
    reset_peak,
    offload,
    offload_params,
    onload,
    onload_params,
    prepin_host_memory,
    sleep_tensors,
)
from vime_core.trainer.optimizer import (
    build_optimizer,
    build_scheduler,
    ddp_config,
    load_optimizer_state,
    optimizer_state,
    restore_scheduler,
)
from vime_core.trainer.out_of_memory import is_out_of_memory, out_of_memory_error
from vime_core.trainer.parallel import init_parallel, layout_for
from vime_core.trainer.peft_export import write_peft_folder
from vime_core.trainer.rollout_training import train_on_rollout
from vime_core.trainer.teacher import check_teacher_checkpoint
from vime_core.trainer.train_step import check_batch, forward_log_probs
from vime_core.trainer.truncation import Sampling
from vime_core.utils.errors import PartiallyTrainedError, first_line
from vime_core.utils.timing import timed
from vime_core.weight_sync.adapter_publish import publish_adapter
from vime_core.weight_sync.allocator import use_expandable_segments
from vime_core.weight_sync.publish import publish_weights
from vime_core.weight_sync.publish_loop import PublishLoop
from vime_core.weight_sync.transport.ipc import cuda_device_uuid, default_reduce
from vime_core.weight_sync.transport.ipc_peers import PeerChannel, follow_publish
from vime_core.weight_sync.weight_check import probe_batch, probe_length, probe_tokens

log = logging.getLogger(__name__)

# Metrics of the last few trained rollouts, returned again when a retried train call is skipped.
KEEP_METRICS = 8


class MegatronTrainer:
    """One TP x DP rank of the trainer (interface in docs/interfaces.md, "Trainer side")."""

    def __init__(
        self,
        cfg: VimeConfig,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        engine_token: Optional[Callable[[], Optional[EngineToken]]] = None,
    ) -> None:
        """`engine_token`: asked at each publish for the token the engines expect (run_actors
        passes the run's RolloutManager's, vime_core/cluster/engine_token.py); None: none is
        sent unless the publisher was made with one."""
        self.cfg = cfg
        self._engine_token = engine_token
        self.layout = layout_for(rank, world_size, cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size)
        self.master_addr, self.master_port = master_addr, int(master_port)
        self.device = torch.device("cuda" if cfg.device == "cuda" else "cpu")
        self.weight_version = 0
        self.last_trained_rollout_id: Optional[int] = None
        self.optimizer_steps = 0  # a retried rollout id must not add any (tests check it); skipped ones neither
        self.skips = SkipCounter(cfg.max_skipped_steps)  # the policy's skipped steps (trainer/nonfinite.py)
        self.hf_checkpoint: Optional[str] = None
        self._restored: Optional[dict[str, Any]] = None  # what `restore` returned: the run's startup is done
        # the rollout whose training failed (non-finite steps, or any error) after some of its steps
        # were applied, or that the run guard rejected once trained: the weights are then neither
        # the last trained rollout's nor the next one's (state()); bootstrap rebuilds the group
        self._diverged: Optional[int] = None
        self.model: Any = None
        self.optimizer: Any = None
        self.scheduler: Any = None  # Megatron's OptimizerParamScheduler, one step per optimizer step
        self.ref_model: Any = None  # the KL terms' reference, unless ref_is_base_model
        self.ref_is_base_model = False  # LoRA: the reference is the policy with its adapters off
        self.critic: Any = None  # the value model of an estimator with a critic (trainer/critic.py)
        self.teacher_model: Any = None  # use_opd's frozen teacher (opd_teacher_load)
        self.arch: Any = None
        self._metrics: dict[int, dict[str, Any]] = {}
        self._asleep = False  # optimizer state and gradient buffers are on the host
        self._params_asleep = False  # so are the parameters
        self._offloaded: list[Any] = []  # what sleep() moved to the host, for wake()
        self._offloaded_params: list[Any] = []  # the parameters, released after the publish that read them
        self._publisher: Any = None  # rank 0's PublishLoop: engine clients and bucket pools between publishes
        self._peers: Any = None  # PeerChannel of all ranks for an IPC publish from several (ipc_peers.py)

    # ---- setup ---------------------------------------------------------------------------------

    def init(self, hf_checkpoint: Optional[str] = None) -> dict[str, Any]:
        """Build model + optimizer from an HF checkpoint (idempotent: a second call is a no-op)."""
        if self.model is not None:
            return self.state()
        path = hf_checkpoint or self.cfg.hf_checkpoint
        if not path:
            raise ValueError("hf_checkpoint is empty: pass the HF checkpoint folder to init()")
        if self.cfg.bf16 and self.device.type != "cuda":
            raise ValueError(
                "bf16=true needs device=cuda (Megatron's mixed-precision optimizer checks CUDA tensor types)"
            )
        lay = self.layout
        if self.device.type == "cuda":  # before the first allocation (vime_core/weight_sync/allocator.py)
            use_expandable_segments()
        init_parallel(
            lay.rank,
            lay.world_size,
            self.master_addr,
            self.master_port,
            lay.tp_size,
            self.device.type,
            ep_size=lay.ep_size,
        )
        if lay.world_size > 1 and weight_transport(self.cfg) == "ipc":  # every rank makes it (ipc_peers.py)
            self._peers = PeerChannel(torch.distributed.new_group(backend="gloo"), lay.rank)
        seed_everything(self.cfg.seed)
        self.arch = architecture_from_hf(read_hf_config(path))
        check_router_losses(self.arch, self.cfg)
        check_routing_replay(self.arch, self.cfg)
        check_ep_divides(self.arch, lay.ep_size)
        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float32

        def load_model(
            checkpoint, arch: Any = None, router_losses: Optional[dict[str, Any]] = None, routing_replay: bool = False
        ) -> Any:
            arch = arch or self.arch
            model = build_gpt_model(
                arch,
                lay.tp_size,
                dtype,
                self.device,
                recompute_settings(self.cfg),
                fusion_settings(self.cfg, self.device),
                router_losses,
                routing_replay,
                lay.ep_size,
                grouped_experts(self.cfg, self.device),
            )
            load_hf_into_model(model, checkpoint, arch, lay.tp_size, lay.tp_rank, lay.ep_size, lay.ep_rank)
            return model

        # the router losses train the policy alone: the frozen models run no router loss, the critic's
        # value loss gets none. Routing replay serves the policy and the reference, whose log-probs
        # are compared with the engine's; the critic and the teacher route by themselves.
        replay = self.cfg.use_rollout_routing_replay
        policy = load_model(path, router_losses=router_loss_settings(self.cfg), routing_replay=replay)
        if lora_enabled(self.cfg):  # base frozen, adapters only in DDP's buffers and the optimizer
            apply_lora(policy, self.cfg, self.arch, lay.tp_size, lay.tp_rank)
        self.model = self._wrap_ddp(policy)
        self.optimizer = build_optimizer(self.cfg, self.model, dtype)
        self.scheduler = build_scheduler(self.cfg, self.optimizer)
        # LoRA without ref_load: the initial weights are the base the adapters sit on, so the
        # reference is the policy with its adapters off (rollout_training.py), not a second copy
        self.ref_is_base_model = needs_reference(self.cfg) and lora_enabled(self.cfg) and not self.cfg.ref_load
        if needs_reference(self.cfg) and not self.ref_is_base_model:  # frozen: ref_load, else the initial weights
            ref = load_model(self._reference_checkpoint(path), routing_replay=replay)
            self.ref_model = ref.eval().requires_grad_(False)
        if needs_critic(self.cfg):  # the same layout as the policy, its own optimizer
            self.critic = Critic.build(
                self.cfg, self.arch, path, lambda arch, ckpt: load_model(ckpt, arch), self._wrap_ddp, dtype, self.device
            )
        if needs_teacher(self.cfg):  # frozen, its own architecture, the student's vocabulary (trainer/teacher.py)
            teacher_arch = architecture_from_hf(check_teacher_checkpoint(path, self.cfg.opd_teacher_load))
            self.teacher_model = load_model(self.cfg.opd_teacher_load, teacher_arch).eval().requires_grad_(False)
        self.hf_checkpoint = str(path)
        if self.cfg.offload_train and self.cfg.offload_train_prepin and self.device.type == "cuda":
            self._prepin_host_memory()
        log.info(
            "trainer rank %d (tp %d/%d, dp %d/%d, ep %d/%d) ready from %s",
            lay.rank,
            lay.tp_rank,
            lay.tp_size,
            lay.dp_rank,
            lay.dp_size,
            lay.ep_rank,
            lay.ep_size,
            path,
        )
        return self.state()

    def _prepin_host_memory(self) -> None:
        with timed() as pinning:
            tensors = sleep_tensors(self.model, self.optimizer, self._frozen_models())
            pinned = prepin_host_memory(tensors, self.optimizer)
        log.info(
            "trainer rank %d: pinned %.2f GiB of host memory for its first sleep in %.2f s",
            self.layout.rank,
            pinned / 2**30,
            pinning.seconds,
        )

    def _reference_checkpoint(self, policy_path: Any) -> Any:
        """The reference policy's HF folder: ref_load when set (checked to be the policy's
        architecture, since the KL compares their log-probs token by token), else the policy's."""
        if not self.cfg.ref_load:
            return policy_path
        from pathlib import Path

        ref = Path(self.cfg.ref_load)
        if not (ref / "config.json").is_file():
            raise FileNotFoundError(f"ref_load={self.cfg.ref_load!r}: no HF checkpoint there (config.json missing)")
        ref_arch = architecture_from_hf(read_hf_config(ref))
        if ref_arch != self.arch:
            raise ValueError(
                f"ref_load={self.cfg.ref_load!r} is not the architecture of hf_checkpoint ({ref_arch} vs {self.arch})"
            )
        return ref

    def _wrap_ddp(self, model: Any) -> Any:
        from megatron.core.distributed import DistributedDataParallel

        return DistributedDataParallel(config=model.config, ddp_config=ddp_config(self.cfg), module=model)

    def state(self) -> dict[str, Any]:
        return {
            "rank": self.layout.rank,
            "weight_version": self.weight_version,
            "last_trained_rollout_id": self.last_trained_rollout_id,
            "optimizer_steps": self.optimizer_steps,
            "hf_checkpoint": self.hf_checkpoint,
            "initialised": self.model is not None,
            "restored": self._restored is not None,
            # not None: this rollout's finite steps were applied before its non-finite ones stopped
            # the run; training it again would train them twice (run_actors rebuilds the group)
            "diverged_rollout_id": self._diverged,
        }

    def _require_init(self) -> None:
        if self.model is None:
            raise RuntimeError("MegatronTrainer.init(hf_checkpoint) has not been called")

    # ---- training ------------------------------------------------------------------------------

    def train(self, rollout_id: int, batch: dict[str, list]) -> dict[str, Any]:
        """Train on this rank's DP partition of rollout ``rollout_id`` (idempotent per id).
        skipped_steps (and critic_skipped_steps with a critic): how many of its optimizer steps had
        a non-finite loss or gradient and were skipped; NonFiniteStepsError after too many in a
        row (trainer/nonfinite.py), the rollout then not marked trained."""
        self._require_init()
        if self.last_trained_rollout_id is not None and rollout_id <= self.last_trained_rollout_id:
            return {**self._metrics.get(rollout_id, {}), "rollout_id": rollout_id, "skipped": True}
        if self._diverged is not None:  # a retry on these weights would apply steps a second time
            raise PartiallyTrainedError(
                f"rollout {rollout_id}: this trainer holds steps of rollout {self._diverged} applied before it "
                f"failed; it trains again once rebuilt from its last checkpoint"
            )
        reset_peak()  # memory_after_train's peak: this wake and train
        with timed() as waking:
            woke = self.wake()
        with timed() as training:
            counters = [self.skips] + ([self.critic.skips] if self.critic is not None else [])
            for counter in counters:
                counter.begin(rollout_id)
            try:
                metrics = train_on_rollout(self, batch, rollout_id)
            except Exception as exc:
                applied = sum(counter.applied for counter in counters)
                if not applied:
                    raise  # the weights are those from before the rollout: a retry is safe
                self._diverged = rollout_id
                if isinstance(exc, NonFiniteStepsError):
                    raise
                raise partially_trained(rollout_id, applied, exc) from exc
        metrics.update(
            rollout_id=rollout_id,
            train_time_s=training.seconds,
            skipped=False,
            wake_time_s=waking.seconds,
            memory_after_wake=woke,
            memory_after_train=device_memory(),
        )
        # counts, where the per-step metrics (averaged over the steps) hold each step's 0 or 1
        metrics["skipped_steps"] = self.skips.skipped
        if self.critic is not None:
            metrics["critic_skipped_steps"] = self.critic.skips.skipped
        self.last_trained_rollout_id = rollout_id
        self.optimizer_steps += int(metrics.get("num_steps", 0)) - self.skips.skipped
        self._metrics[rollout_id] = metrics
        for old in sorted(self._metrics)[:-KEEP_METRICS]:
            del self._metrics[old]
        return metrics

    def discard_trained(self, rollout_id: int) -> dict[str, Any]:
        """The run guard rejected rollout `rollout_id` after it was trained (tasks/guard.py): the
        weights hold its steps, so, as after non-finite steps, state()'s diverged_rollout_id makes
        the next bootstrap rebuild the group from the last checkpoint. Nothing is saved."""
        if self.last_trained_rollout_id is not None and rollout_id <= self.last_trained_rollout_id:
            self._diverged = rollout_id
        return self.state()

    def compute_log_probs(self, batch: dict[str, list]) -> list[list[float]]:
        """Response-token log-probs of every sample under the current weights (sample order)."""
        self._require_init()
        n = check_batch(batch)
        size = self.cfg.micro_batch_size
        mbs = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
        lps = forward_log_probs(
            self.model,
            batch,
            mbs,
            self.arch.vocab_size,
            Sampling.of(self.cfg),
            self.device,
            self.cfg.use_rollout_routing_replay,
        )
        return [lps[i].tolist() for i in range(n)]

    # ---- weights out ---------------------------------------------------------------------------

    def iter_hf_weights(self, defer_merge: bool = False) -> Iterator[tuple[str, Any]]:
        """Full HF-named tensors (a collective over this rank's TP and EP groups); ``defer_merge``:
        LoRA's merged weights as DeferredTensors (hf_convert.iter_hf_weights)."""
        self._require_init()
        return iter_hf_weights(self.model, self.arch, defer_merge=defer_merge)

    def publish(self, engine_urls: Optional[list[str]], target_version: Optional[int] = None, *after: Any) -> Any:
        """Publish the weights to the engines as ``weight_version + 1`` (or ``target_version``).

        Rank 0 publishes; the other ranks holding the first copy of the weights (its TP group and,
        with expert parallelism, the EP ranks holding the other experts) take part in the gathers;
        the other ranks hold the same weights and only advance their version counter. Over CUDA IPC
        with more than one rank, every rank also packs each bucket on its own GPU for the engine
        workers there (transport/ipc_peers.py).
        With lora_publish=adapter only the LoRA adapter goes (`_publish_adapter`).

        ``engine_urls`` None (the RolloutManager's `begin_sync` found every engine already at the
        target version) publishes nothing and returns None: sync chains this call on that
        answer inside Ray, without a round trip through the driver. ``after`` is ignored:
        references passed there (every rank's train call, tasks.sync.submit_publish) make Ray run the
        publish only once they succeeded."""
        if engine_urls is None:
            return None
        self._require_init()
        new_version = self.weight_version + 1 if target_version is None else int(target_version)
        result: Any = new_version
        reset_peak()  # trainer_memory_after_publish's peak: this publish
        if self._params_asleep:
            self._wake_params()  # the optimizer state stays on the host: the engines are awake
        peers = self._peers
        if serves_adapters(self.cfg):
            result = self._publish_adapter(engine_urls, new_version)
        elif self.layout.holds_first_copy or peers is not None:
            # rank 0 sends: LoRA's merged weights made bucket by bucket (hf_convert.iter_hf_weights)
            weights = self.iter_hf_weights(defer_merge=self.layout.rank == 0)
            try:
                if self.layout.rank == 0:
                    self._publisher = self._publisher or PublishLoop(token_source=self._engine_token)
                    result = publish_weights(
                        weights, engine_urls, new_version, self.cfg, loop=self._publisher, peers=peers
                    )
                elif peers is not None:
                    device = torch.device("cuda", torch.cuda.current_device())
                    follow_publish(weights, peers, device, cuda_device_uuid(device), default_reduce)
            finally:
                if peers is not None and self.layout.rank == 0:
                    peers.release()  # the other ranks free their buffers, also after a failure
                for _ in weights:  # finish the TP/EP gathers so the other ranks are not left waiting
                    pass
        self.weight_version = new_version
        probe = self.probe_log_probs() if self.cfg.check_weight_update_equal else None
        if self._asleep:  # put to sleep with its weights kept for this publish: they go now
            self._release_params()
        if isinstance(result, dict):
            result["trainer_memory_after_publish"] = device_memory()
            if probe is not None:
                result["probe"] = probe
        return result

    def _publish_adapter(self, engine_urls: list[str], new_version: int) -> Any:
        """lora_publish=adapter: the engines load the adapter as `adapter_name(new_version)`
        (vime_core/weight_sync/adapter_publish.py); their base weights never change. Every TP rank
        of DP replica 0 gathers the adapter, rank 0 publishes it and returns its stats."""
        if self.layout.dp_rank != 0:
            return new_version
        adapter = lora_hf_state(self.model, self.arch)  # a TP collective
        if self.layout.rank != 0:
            return new_version
        token = self._engine_token() if self._engine_token is not None else None
        return publish_adapter(
            adapter, lora_settings(self.cfg), engine_urls, new_version, self.hf_checkpoint, token=token
        )

    def probe_log_probs(self) -> dict[str, Any]:
        """The trainer's half of `check_weight_update_equal` (vime_core/weight_sync/weight_check):
        the probe's tokens and their log-probs under the current weights (every TP rank
        takes part)."""
        tokens = probe_tokens(self.arch.vocab_size, self.cfg.seed, probe_length(self.cfg.rollout_max_context_len))
        batch = probe_batch(tokens)
        with torch.no_grad():
            lps = forward_log_probs(self.model, batch, [[0]], self.arch.vocab_size, 1.0, self.device)
        return {"tokens": tokens, "log_probs": lps[0].tolist()}

    def export_hf(self, path: str) -> str:
        """Write an HF checkpoint folder (safetensors + config + tokenizer) at ``path``, a local
        folder or a storage URI; rank 0 returns where it is (vime_core/trainer/hf_export.py), the
        other ranks ``path``."""
        self._require_init()
        where = str(path)
        with self._awake(weights_only=True):
            if self.layout.holds_first_copy:
                weights = self.iter_hf_weights()
                if self.layout.rank == 0:
                    where = write_hf_folder(
                        weights, self.hf_checkpoint, path, S3Endpoint.of(self.cfg), label=f"v{self.weight_version}"
                    )
                else:
                    for _ in weights:
                        pass
            torch.distributed.barrier()
        return where

    def export_peft(self, path: str) -> str:
        """Write the LoRA adapter as a PEFT adapter folder (adapter_config.json +
        adapter_model.safetensors) at ``path``, a local folder or a storage URI, for
        ``peft.PeftModel.from_pretrained`` on the HF base (vime_core/trainer/peft_export.py); rank 0
        returns where it is, the other ranks ``path``. The adapters are gathered over TP."""
        self._require_init()
        if not lora_enabled(self.cfg):
            raise ValueError("export_peft needs LoRA adapters: this run trains the full weights (lora_rank=0)")
        where = str(path)
        with self._awake(weights_only=True):
            if self.layout.dp_rank == 0:
                adapter = lora_hf_state(self.model, self.arch)  # a TP collective
                if self.layout.rank == 0:
                    where = write_peft_folder(
                        adapter,
                        lora_settings(self.cfg),
                        self.hf_checkpoint,
                        path,
                        endpoint=S3Endpoint.of(self.cfg),
                        label=f"v{self.weight_version}",
                    )
            torch.distributed.barrier()
        return where

    @contextlib.contextmanager
    def _awake(self, weights_only: bool = False):
        """Wake for a read of the device state (checkpoint; `weights_only`: an export, which reads
        the parameters alone, so the optimizer state stays on the host beside awake engines); back
        to sleep afterwards if it slept (offload_train), with its weights too if they were released."""
        was_asleep, weights_asleep = self._asleep, self._params_asleep
        if weights_only:
            self._wake_params()
        else:
            self.wake()
        try:
            yield
        finally:
            if was_asleep or weights_asleep:
                self.sleep(keep_weights=not weights_asleep)

    # ---- checkpoints ---------------------------------------------------------------------------

    def save(self, rollout_id: int, extra_state: Optional[dict[str, Any]] = None) -> str:
        """Checkpoint weights, optimizer, RNG, counters and ``extra_state``; returns the folder."""
        self._require_init()
        path = ckpt.checkpoint_dir(self.cfg, rollout_id)
        with self._awake():  # the state dicts read the device tensors
            self._save_state(path, rollout_id, extra_state)
        return path

    def _save_state(self, path: str, rollout_id: int, extra_state: Optional[dict[str, Any]]) -> None:
        # with LoRA: the adapters, not the frozen base
        model_state, base = checkpoint_model_state(self.model, lora_enabled(self.cfg))
        state = {
            "model": model_state,
            "lora_base_fingerprint": base,
            **optimizer_state(self.optimizer, self.scheduler),  # optimizer, scheduler (, shards)
            "rng": ckpt.capture_rng_state(),
            "weight_version": self.weight_version,
            "last_trained_rollout_id": self.last_trained_rollout_id,
            "optimizer_steps": self.optimizer_steps,
            "metrics": self._metrics,
            "extra_state": dict(extra_state or {}),
        }
        endpoint = S3Endpoint.of(self.cfg)  # the run's store, whatever this node's environment says
        critic_path = ckpt.checkpoint_dir(self.cfg, rollout_id, critic=True)  # `path` unless critic_save
        ckpt.save_rank_state(path, self.layout.rank, state, endpoint)
        if self.critic is not None:
            ckpt.save_rank_state(critic_path, self.layout.rank, self.critic.state(), endpoint, critic=True)
        torch.distributed.barrier()
        if self.layout.rank == 0:
            lay = self.layout
            ranks = range(lay.world_size)
            ckpt.write_manifest(
                path,
                {
                    "rollout_id": rollout_id,
                    "world_size": lay.world_size,
                    "tp": lay.tp_size,
                    "dp": lay.dp_size,
                    "ep": lay.ep_size,
                    "weight_version": self.weight_version,
                    "hf_checkpoint": self.hf_checkpoint,
                    "files": [ckpt.rank_file_name(r) for r in ranks],
                    "critic_files": [ckpt.rank_file_name(r, critic=True) for r in ranks]
                    if self.critic is not None
                    else [],
                    "critic_dir": critic_path if self.critic is not None and critic_path != path else None,
                },
                endpoint,
            )
        torch.distributed.barrier()

    def restore(self, path: Optional[str]) -> dict[str, Any]:
        """The run's startup restore, once per actor: `load(path)` when a checkpoint is given (its
        extra_state is returned), nothing when the run starts fresh. A bootstrap retried, or a
        driver restarted, that finds this rank alive sees `state()["restored"]`: a rank whose
        startup stopped between `init` and here is restored then, and one restored already is
        not restored twice (which would roll back what it trained since)."""
        if self._restored is None:
            self._restored = self.load(path) if path is not None else {}
        return dict(self._restored)

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by ``save`` with the same layout; returns its extra_state."""
        self._require_init()
        lay = self.layout
        state = ckpt.load_rank_state(
            path, lay.rank, lay.world_size, lay.tp_size, S3Endpoint.of(self.cfg), ep_size=lay.ep_size
        )
        check_lora_state(state["model"], self.model.state_dict(), self.cfg.lora_rank, path)
        load_model_state(self.model, state["model"], state.get("lora_base_fingerprint"), path)
        load_optimizer_state(self.optimizer, state, path)
        ckpt.restore_rng_state(state["rng"])
        self.weight_version = int(state["weight_version"])
        self.last_trained_rollout_id = state["last_trained_rollout_id"]
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.scheduler = build_scheduler(self.cfg, self.optimizer)
        restore_scheduler(self.scheduler, state.get("scheduler"), self.optimizer_steps, path)
        self._metrics = dict(state.get("metrics") or {})
        if self.critic is not None:
            self._load_critic(path)
        return dict(state["extra_state"])

    def _load_critic(self, path: str) -> None:
        """The critic's weights, optimizer and schedule from the checkpoint's critic files, in
        the folder its manifest names (critic_save when it was saved with one, whatever this
        run's critic_save); one written without a critic (another estimator) leaves the critic
        as initialised, logged."""
        lay, endpoint = self.layout, S3Endpoint.of(self.cfg)
        manifest = ckpt.read_manifest(path, endpoint)
        if not manifest.get("critic_files"):
            log.warning(
                "%s holds no critic (saved by a run without one): the critic starts from %s",
                path,
                self.cfg.critic_load or self.hf_checkpoint,
            )
            return
        state = ckpt.load_rank_state(
            path, lay.rank, lay.world_size, lay.tp_size, endpoint, critic=True, ep_size=lay.ep_size
        )
        self.critic.load_state(state, ckpt.critic_dir(path, manifest))

    # ---- memory between phases ---------------------------------------------------------------

    def sleep(self, keep_weights: bool = False) -> dict[str, Any]:
        """Free device memory for the engines (offload_train): optimizer state, fp32 main
        parameters and gradient buffers to pinned host memory; the parameters too unless
        `keep_weights` (a publish reads them next and releases them when done). A logged no-op
        on CPU. Returns the bytes freed and this rank's allocator afterwards."""
        self._require_init()
        freed = 0
        if self.device.type == "cuda" and not self._asleep:
            freed, copies = offload(self.model, self.optimizer, keep_params=True)
            for frozen in self._frozen_models():  # they sleep with the policy; wake restores all
                frozen_freed, frozen_copies = offload_params(frozen)
                freed, copies = freed + frozen_freed, copies + frozen_copies
            if self.critic is not None:  # all of it: no publish reads the critic
                freed += self.critic.sleep()
            self._offloaded += copies
            self._asleep = True
        if not keep_weights:
            freed += self._release_params()
        return {"freed_bytes": freed, "asleep": self._asleep, "weights_asleep": self._params_asleep, **device_memory()}

    def _frozen_models(self) -> list[Any]:
        """The frozen models that sleep with the policy: the reference and the teacher, when loaded."""
        return [m for m in (self.ref_model, self.teacher_model) if m is not None]

    def _release_params(self) -> int:
        if self.device.type != "cuda" or self._params_asleep:
            return 0
        freed, self._offloaded_params = offload_params(self.model)
        self._params_asleep = True
        return freed

    def _wake_params(self) -> int:
        """The parameters alone back on the device; the bytes allocated."""
        if not self._params_asleep:
            return 0
        allocated = onload_params(self._offloaded_params)
        self._offloaded_params, self._params_asleep = [], False
        return allocated

    def wake(self) -> dict[str, Any]:
        self._require_init()
        if not self._asleep and not self._params_asleep:
            return {"allocated_bytes": 0, "asleep": False, **device_memory()}
        allocated = self._wake_params()
        if self._asleep:
            allocated += onload(self.model, self._offloaded)
            if self.critic is not None:
                allocated += self.critic.wake()
            self._offloaded, self._asleep = [], False
        return {"woken_bytes": allocated, "asleep": False, **device_memory()}

    def close(self) -> None:
        """Give back what publishing keeps (engine connections, shared-memory bucket files);
        the next publish makes them again. Also run at the process's exit."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close()

    def memory(self) -> dict[str, Any]:
        """This rank's allocator (allocated/reserved bytes); empty on CPU."""
        return {"rank": self.layout.rank, **device_memory()}


def partially_trained(rollout_id: int, applied: int, exc: Exception) -> PartiallyTrainedError:
    """The error of a rollout whose training raised `exc` after `applied` optimizer steps: one line
    saying so and what failed, carrying the failure (out of device memory as TrainerActor.call
    reports it) for its fault kind."""
    failure = out_of_memory_error("train", exc) if is_out_of_memory(exc) else exc
    return PartiallyTrainedError(
        f"rollout {rollout_id}: {applied} optimizer step(s) were applied before training failed; the trainer is "
        f"rebuilt from its last checkpoint before it trains again ({type(failure).__name__}: {first_line(failure)})",
        failure,
    )
