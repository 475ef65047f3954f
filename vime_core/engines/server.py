"""One vLLM server process: launch (or attach), wait for health, shut down without hanging. The server
runs in the vLLM environment's interpreter (`cfg.vllm_python`), so the trainer's environment never
imports vllm; a run makes each `EngineServer` a Ray actor in its device bundle (run_actors.py), and
this module does not import ray."""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import socket
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from vime_core.config import engine_server_args, num_engines
from vime_core.config.derive import engine_env, platform_supports_sleep
from vime_core.engines.adapters import RUNTIME_UPDATES_ENV, lora_server_args, serves_adapters
from vime_core.engines.auth import MIDDLEWARE, OPEN_HEALTH_ENV, TOKEN_ENV, EngineToken, auth_headers
from vime_core.engines.client import SyncEngineClient
from vime_core.utils.secrets import redact_url
from vime_core.engines.startup_log import describe, launch_line, startup_marks
from vime_core.engines.vllm_api import VERSIONED_API_SINCE, VllmApi, installed_version
from vime_core.engines.vllm_cache import CarriedCache, engine_triton_cache
from vime_core.engines.vllm_side.api_server import INSPECT_ENV
from vime_core.utils.device_memory import free_and_total, group_device_memory
from vime_core.utils.errors import InfrastructureError
from vime_core.utils.orphan_guard import guard_command
from vime_core.utils.processes import free_port, log_tail, port_is_free, terminate_group
from vime_core.utils.retry import poll_until
from vime_core.utils.secrets import redact_secrets

if TYPE_CHECKING:
    from vime_core.config import VimeConfig

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_TAIL_LINES = 40
# A port picked free may be taken before vLLM binds it, its imports later (an outbound
# connection's ephemeral port, another server's): the launch then fails at once, and is made
# again on another port, at most this many times in all.
PORT_ATTEMPTS = 3
ADDRESS_IN_USE = "Address already in use"
BUILTIN_WEIGHT_BACKENDS = ("ipc", "nccl")  # vLLM's own, CUDA only
# Loaded into vLLM's workers for vime's own weight-transfer backends (e.g. "vime_shm" on CPU).
VIME_WORKER_EXTENSION = "vime_core.engines.vllm_side.worker_ext.VimeWorkerExtension"
TCMALLOC_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
)


class EngineStartError(RuntimeError, InfrastructureError):
    """The server did not become healthy; the message ends with its last log lines."""


class DeviceMemoryError(ValueError):
    """The engine's memory setting asks for more device memory than is free: a setting to change
    (a ValueError, so the run does not retry it), found before vLLM is launched."""


def resolve_python(vllm_python: str) -> Path:
    """`cfg.vllm_python`, relative paths taken from the repository root."""
    path = Path(vllm_python)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not path.exists():
        raise FileNotFoundError(f"vllm_python={vllm_python!r}: {path} does not exist (run infra/setup_env.sh)")
    return path


def _ranges(cores: list[int]) -> str:
    """[0,1,2,5] -> "0-2,5" (the syntax of VLLM_CPU_OMP_THREADS_BIND)."""
    parts, start = [], None
    for i, core in enumerate(cores):
        if start is None:
            start = core
        if i + 1 == len(cores) or cores[i + 1] != core + 1:
            parts.append(str(start) if start == core else f"{start}-{core}")
            start = None
    return ",".join(parts)


def cpu_sets(
    engine_index: int, engines_per_node: int, tp_size: int = 1, cores: Optional[list[int]] = None
) -> list[list[int]]:
    """The cores of each TP rank of engine `engine_index`: the node's cores split evenly between its
    engines (engine i gets the i-th slice), each engine's slice split between its TP ranks. With
    more engines than cores, engines wrap around and share (a warning says so)."""
    cores = sorted(cores if cores is not None else os.sched_getaffinity(0))
    slots = engines_per_node * tp_size
    if slots > len(cores):
        logger.warning("%d engine ranks on %d cores: engines will share cores", slots, len(cores))
    per_rank = max(1, len(cores) // slots)
    local = engine_index % engines_per_node
    first = [(local * tp_size + rank) * per_rank for rank in range(tp_size)]
    return [sorted({cores[(f + j) % len(cores)] for j in range(per_rank)}) for f in first]


def cpu_bind(engine_index: int, engines_per_node: int, tp_size: int = 1, cores: Optional[list[int]] = None) -> str:
    """`cpu_sets` in VLLM_CPU_OMP_THREADS_BIND's syntax: "0-1|2-3" (one set per TP rank)."""
    return "|".join(_ranges(s) for s in cpu_sets(engine_index, engines_per_node, tp_size, cores))


def _module_file(dotted_class: str) -> Optional[Path]:
    """Where a `vime_core.` class path's module would live in this repository (None: not ours)."""
    module = dotted_class.rsplit(".", 1)[0]
    if not module.startswith("vime_core."):
        return None
    return REPO_ROOT / (module.replace(".", "/") + ".py")


def advertised_host(bind_host: str) -> str:
    """The address other processes reach a server bound to `bind_host` at: loopback stays
    loopback; a wildcard bind is advertised as this node's address (Ray's view of it when
    this process is part of a Ray cluster)."""
    if bind_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1" if bind_host != "::1" else "[::1]"
    if bind_host not in ("0.0.0.0", "", "::"):
        return bind_host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostbyname(socket.gethostname())


class EngineServer:
    """Starts (or attaches to) one vLLM server. Plain class; a run makes it a Ray actor (run_actors).

    `url` is the server's base URL once started. `start()` blocks until /health answers (or
    raises `EngineStartError` with the last log lines), `shutdown()` pauses with abort then
    terminates, `restart()` does both and returns the (possibly new) URL. `prestart()` begins a
    start that a later `start()` waits for (an actor's start begun before its caller is ready).

    The command is vLLM's api_server (or serve_cli with vllm_api_server_count > 1) with
    --logprobs-mode processed_logprobs (log-probs after temperature, what training needs), the trainer's
    dtype, VimeWorkerExtension and, with engine_auth, EngineAuthMiddleware; its environment gets
    VLLM_SERVER_DEV_MODE=1, a CPU core set per engine (cpu_bind), the devices of the engine's bundles,
    the repository on PYTHONPATH, and the run's token (VIME_ENGINE_TOKEN: never on the command line,
    which is logged and which `ps` shows). Which vLLM release runs decides a few flags (vllm_api).
    """

    def __init__(
        self,
        cfg: "VimeConfig",
        engine_index: int = 0,
        *,
        model_path: Optional[str] = None,
        attach_url: Optional[str] = None,
        engines_per_node: Optional[int] = None,
        server_args: Optional[dict] = None,
        worker_extension_cls: Optional[str] = None,
        weight_transfer_config: Optional[dict] = "from_cfg",  # type: ignore[assignment]
        extra_env: Optional[dict[str, str]] = None,
        log_dir: Optional[str] = None,
        warmup: bool = True,
        device_ids: Optional[Union[list[str], Callable[[], list[str]]]] = None,
        api: Optional[VllmApi] = None,
        token: Optional[EngineToken] = None,
    ) -> None:
        """`token`: the run's engine token (all of a run's engines share one: the router forwards
        one client's header to any of them); None makes one for this server when cfg.engine_auth.
        `device_ids`: the devices the server sees, or what finds them in this process (an engine
        actor's: cluster/run_actors.EngineDevices).
        Attached servers (`attach_url`) are sent `token` when given, and nothing else."""
        self.cfg = cfg
        self.engine_index = engine_index
        self.name = f"engine-{engine_index}"
        model = model_path or cfg.hf_checkpoint
        self.model_path = str(Path(model).resolve()) if model else ""
        self.attach_url = attach_url
        if attach_url:
            self.auth_token = token
        else:
            self.auth_token = (token or EngineToken.new()) if cfg.engine_auth else None
        self.engines_per_node = engines_per_node or num_engines(cfg)
        self.server_args = dict(engine_server_args(cfg))
        if serves_adapters(cfg):  # lora_publish=adapter: vLLM's LoRA support (engines/adapters.py)
            self.server_args.update(lora_server_args(cfg.lora_rank))
        self.server_args.update(server_args or {})
        if weight_transfer_config != "from_cfg":
            self.server_args["weight_transfer_config"] = weight_transfer_config
        if worker_extension_cls is not None:
            self.server_args["worker_extension_cls"] = worker_extension_cls
        self.extra_env = dict(extra_env or {})
        if callable(device_ids):
            device_ids = device_ids()
        self.device_ids = [str(d) for d in device_ids] if device_ids is not None else None
        self._api = api
        self.log_dir = Path(log_dir) if log_dir else REPO_ROOT / ".cache" / "engine-logs"
        self.warmup = warmup
        self.port: Optional[int] = None
        self.url: Optional[str] = attach_url.rstrip("/") if attach_url else None
        self.log_path: Optional[Path] = None
        self._proc: Optional[subprocess.Popen] = None
        self._log_file: Any = None
        # one start at a time: a start() that comes while prestart() launches waits for it,
        # then finds its server (not a second launch, not a URL that is not serving yet)
        self._start_lock = threading.Lock()
        self._prestart_failure: Optional[BaseException] = None
        self._carried_cache: Optional[CarriedCache] = None  # vllm_cache_uri's archives, restored once
        self.cache_moves: list[dict] = []  # what each restore and store of it did

    # ---- what is launched -------------------------------------------------------------------

    def cpu_cores(self) -> Optional[list[int]]:
        """The cores of a one-rank engine on CPU that runs as one engine-core process (vLLM's "uni"
        executor, vllm_cpu_single_process; None otherwise), forked from the API server
        (vllm_side/api_server.py). vLLM's CPU build otherwise spawns the engine core and a worker
        process beside it, each importing vLLM and torch again: seconds of every start, for a layout
        the GPU's one-rank engines do not have. The whole server is pinned to the engine's cores
        (orphan_guard --cpus), which the worker process alone is bound to then."""
        tp = int(self.server_args.get("tensor_parallel_size", self.cfg.rollout_num_gpus_per_engine))
        if self.cfg.device != "cpu" or tp != 1 or not self.cfg.vllm_cpu_single_process:
            return None
        return cpu_sets(self.engine_index, self.engines_per_node)[0]

    def command(self, port: int) -> list[str]:
        """The server's command line (without environment)."""
        cfg, args = self.cfg, dict(self.server_args)
        if not self.model_path:
            raise ValueError(
                "hf_checkpoint is empty: EngineServer needs a model folder (model_path or cfg.hf_checkpoint)"
            )
        one_process = self.cpu_cores() is not None  # a one-rank CPU engine: uni executor, forked engine core
        # several front ends only through vLLM's CLI (`vllm serve`, vllm_side/serve_cli.py); one: the
        # server module itself, for a one-rank CPU engine with its engine core forked (vllm_side/api_server.py)
        if cfg.vllm_api_server_count > 1:
            entry = [
                "vime_core.engines.vllm_side.serve_cli",
                "serve",
                "--api-server-count",
                str(cfg.vllm_api_server_count),
            ]
        elif one_process or engine_env(cfg).get(INSPECT_ENV) == "1":
            entry = ["vime_core.engines.vllm_side.api_server"]
        else:
            entry = ["vllm.entrypoints.openai.api_server"]
        cmd = [
            str(resolve_python(cfg.vllm_python)),
            "-m",
            *entry,
            "--model",
            str(self.model_path),
            "--host",
            cfg.engine_bind_host,
            "--port",
            str(port),
            *(["--enable-scale-out"] if self.api().scale_out_flag else []),
            "--max-model-len",
            str(args.pop("max_model_len", cfg.rollout_max_context_len)),
            "--logprobs-mode",
            str(args.pop("logprobs_mode", "processed_logprobs")),
            "--tensor-parallel-size",
            str(args.pop("tensor_parallel_size", cfg.rollout_num_gpus_per_engine)),
            "--seed",
            str(cfg.seed + self.engine_index),
            # one access-log line per generate request is CPU the rollout needs, and a log that
            # grows by rollout_batch_size * n_samples_per_prompt lines every iteration
            "--disable-uvicorn-access-log",
        ]
        if not cfg.vllm_log_stats:  # per-token statistics in the front end (schema: vllm_log_stats)
            cmd.append("--disable-log-stats")
        if cfg.vllm_enforce_eager:
            cmd.append("--enforce-eager")
        if one_process:
            cmd += ["--distributed-executor-backend", "uni"]
        # Serve in the trainer's precision so rollout log-probs match its recompute.
        cmd += ["--dtype", "bfloat16" if cfg.bf16 else "float32"]
        if cfg.device == "cuda":
            cmd += ["--gpu-memory-utilization", str(cfg.vllm_gpu_memory_utilization)]

        if args.pop("enable_sleep_mode", False):
            if platform_supports_sleep(cfg):
                cmd.append("--enable-sleep-mode")
            else:
                logger.info(
                    "%s: device=%s has no vLLM sleep mode; starting without it (offload is a no-op)",
                    self.name,
                    cfg.device,
                )

        # vime's extension always: publishes are validated against its weight spec, and on
        # vLLM 0.26 it keeps the weight version
        extension = args.pop("worker_extension_cls", None) or VIME_WORKER_EXTENSION
        transfer = args.pop("weight_transfer_config", None)
        backend = (transfer or {}).get("backend")
        if extension and (path := _module_file(extension)) is not None and not path.exists():
            logger.warning("%s: worker extension %s not found (%s); starting without it", self.name, extension, path)
            extension = None
        if transfer and backend not in BUILTIN_WEIGHT_BACKENDS and extension != VIME_WORKER_EXTENSION:
            logger.warning(
                "%s: weight-transfer backend %r has no worker extension loaded; starting without it", self.name, backend
            )
            transfer = None
        if transfer and backend in BUILTIN_WEIGHT_BACKENDS and cfg.device == "cpu":
            logger.warning("%s: vLLM's %r weight transfer needs CUDA; starting without it", self.name, backend)
            transfer = None
        if extension:
            cmd += ["--worker-extension-cls", extension]
        if transfer:
            cmd += ["--weight-transfer-config", json.dumps(transfer)]
        if self.auth_token is not None:  # the token itself only in environment()
            cmd += ["--middleware", MIDDLEWARE]

        for key, value in args.items():  # options added to engine_server_args later
            if value is None or value is False:
                continue
            flag = "--" + key.replace("_", "-")
            cmd += (
                [flag]
                if value is True
                else [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
            )
        cmd += list(cfg.vllm_extra_args)
        return cmd

    def api(self) -> VllmApi:
        """The launched release's differences, from the vLLM environment's package metadata.
        When that cannot be read the newest API is assumed (the server's own log then says
        what is wrong with the environment)."""
        if self._api is None:
            try:
                version = installed_version(resolve_python(self.cfg.vllm_python))
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                logger.warning("%s: cannot tell the vLLM release (%s); assuming >= 0.27", self.name, exc)
                version = ".".join(map(str, VERSIONED_API_SINCE))
            self._api = VllmApi.for_version(version)
        return self._api

    def environment(self) -> dict[str, str]:
        cfg = self.cfg
        env = dict(os.environ)
        env.update(engine_env(cfg))  # vllm_env: none of the names set below (config/derive.py)
        env.update(
            VLLM_SERVER_DEV_MODE="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # shared-memory tensor handles in the weight session
            PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p),
        )
        if cfg.device == "cpu":
            kv_gib = max(1, math.ceil(cfg.vllm_cpu_kvcache_gb))  # vLLM reads whole GiB
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(
                self.engine_index, self.engines_per_node, cfg.rollout_num_gpus_per_engine
            )
            preload = [p for p in TCMALLOC_CANDIDATES if os.path.exists(p)][:1]
            iomp = resolve_python(cfg.vllm_python).parents[1] / "lib" / "libiomp5.so"
            if iomp.exists():
                preload.append(str(iomp))
            if preload:
                env["LD_PRELOAD"] = ":".join(preload + ([env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else []))
            if (cores := self.cpu_cores()) is not None:
                # vLLM's CPU platform keeps the "uni" executor only without multiprocessing, and
                # then serves on one torch thread unless OMP_NUM_THREADS says otherwise (a Ray
                # worker's own OMP_NUM_THREADS is not meant for it)
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
                env["OMP_NUM_THREADS"] = str(len(cores))
        if self.device_ids is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.device_ids)
        # one Triton cache whatever vLLM's compile cache answers, carried with it (vllm_cache.py);
        # a default (ENGINE_DEFAULT_ENV): vllm_env or the actor's environment may name another
        env.setdefault("TRITON_CACHE_DIR", str(engine_triton_cache(env)))
        if serves_adapters(cfg):  # the run-time adapter routes the adapter publish uses
            env.update(RUNTIME_UPDATES_ENV)
        env.update(self.extra_env)
        env.pop(TOKEN_ENV, None)  # a user's token for engine_urls is not this server's
        env.pop(OPEN_HEALTH_ENV, None)
        if self.auth_token is not None:
            env[TOKEN_ENV] = self.auth_token.reveal()
            if cfg.use_router:  # vllm-router's health checks carry no token (vllm_side/auth.py)
                env[OPEN_HEALTH_ENV] = "1"
        return env

    # ---- lifecycle ---------------------------------------------------------------------------

    def client(self) -> SyncEngineClient:
        if self.url is None:
            raise RuntimeError(f"{self.name} is not started")
        return SyncEngineClient(
            self.url, self.name, supports_sleep=platform_supports_sleep(self.cfg), token=self.auth_token
        )

    def get_url(self) -> Optional[str]:
        """`url` for Ray actor handles (attributes are not remote)."""
        return self.url

    def engine_token(self) -> Optional[EngineToken]:
        """`auth_token` for Ray actor handles: a later driver attaching to the run's engines asks
        for it (vime_core/cluster/engine_token.py)."""
        return self.auth_token

    def get_device_ids(self) -> Optional[list[str]]:
        return self.device_ids

    def process_exited(self) -> bool:
        """True when the server this object launched has exited (attached servers: False)."""
        return self._proc is not None and self._proc.poll() is not None

    def memory(self) -> dict[str, Any]:
        """Device memory the server's processes hold and its devices' used memory, in bytes
        (`vime_core/utils/device_memory`); empty on CPU or without nvidia-smi."""
        if self.cfg.device != "cuda" or self._proc is None:
            return {}
        return group_device_memory(self._proc.pid, self.device_ids)

    def is_alive(self) -> bool:
        if self._proc is not None and self._proc.poll() is not None:
            return False
        return self.url is not None and self.client().is_healthy(timeout_s=5.0)

    def start(self) -> str:
        """Launch (or attach) and wait until healthy; the base URL. After a `prestart()`: waits
        for it, then returns its URL or raises its failure (once: a start after that launches)."""
        with self._start_lock:
            if (failure := self._prestart_failure) is not None:
                self._prestart_failure = None
                raise failure
            return self._start()

    def prestart(self) -> None:
        """`start()` begun before the caller that waits for it: `vime train`'s early start
        launches each engine as soon as its actor exists, while the RolloutManager that starts
        and watches the engines is still being made (cluster/run_actors.py). Its failure is
        kept for that caller's `start()`, which raises it as a start of its own would."""
        with self._start_lock:
            try:
                self._start()
            except BaseException as exc:  # noqa: BLE001 - handed to the start() that waits
                self._prestart_failure = exc

    def _start(self) -> str:
        if self.attach_url:
            return self._attach()
        if self._proc is not None and self._proc.poll() is None:
            return self.url  # type: ignore[return-value]
        if self.cfg.device == "cuda":
            self._check_device_memory()
        self._restore_vllm_cache()
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._launch(self.port or free_port())
            try:
                self._wait_healthy(self.cfg.engine_startup_timeout_s)
                break
            except EngineStartError:
                if attempt == PORT_ATTEMPTS or not self._lost_its_port():
                    raise
                logger.warning(
                    "%s: port %d was taken before vLLM bound it; launching again on another port", self.name, self.port
                )
                self._terminate(grace_s=5.0)
                self.port = None
        self._store_vllm_cache()
        if self.warmup:
            self._warm_up()
        return self.url  # type: ignore[return-value]

    def _restore_vllm_cache(self) -> None:
        """vllm_cache_uri: the stored entries this host lacks, before the first launch only (a
        restart finds them on the host)."""
        if not self.cfg.vllm_cache_uri or self._carried_cache is not None:
            return
        self._carried_cache = CarriedCache.of(self.cfg, self.environment())
        moved = {"restore": self._carried_cache.restore()}
        self.cache_moves.append(moved)
        logger.info(
            "%s: vllm_cache_uri %s into %s: %s",
            self.name,
            redact_url(self.cfg.vllm_cache_uri),
            self._carried_cache.root,
            moved,
        )

    def _store_vllm_cache(self) -> None:
        """vllm_cache_uri: the entries this start added files to, back to the store, in
        a thread (the run goes on; a failure is logged, the engine serves all the same)."""
        carried = self._carried_cache
        if carried is None:
            return

        def store() -> None:
            moved = {"store": carried.store()}
            self.cache_moves.append(moved)
            logger.info("%s: vllm_cache_uri %s: %s", self.name, redact_url(self.cfg.vllm_cache_uri), moved)

        threading.Thread(target=store, name=f"{self.name}-vllm-cache", daemon=True).start()

    def _lost_its_port(self) -> bool:
        """The server exited because its port was taken (its log says so)."""
        return self._proc is not None and self._proc.poll() is not None and ADDRESS_IN_USE in self.log_tail()

    def _launch(self, port: int) -> None:
        self.port = port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"{self.name}-{os.getpid()}-{self.port}.log"
        cmd = self.command(self.port)
        self._log_file = open(self.log_path, "ab")
        self._log_file.write(launch_line().encode())  # the zero of startup_marks
        self._log_file.flush()
        logger.info("%s: starting %s (log %s)", self.name, " ".join(redact_secrets(cmd)), self.log_path)
        # Own session: shutdown signals the whole group (API server + engine-core child); under
        # the guard, which stops the group when this process dies (utils/orphan_guard.py).
        self._proc = subprocess.Popen(
            guard_command(cmd, cpus=self.cpu_cores()),
            env=self.environment(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=str(REPO_ROOT),
        )
        self.url = f"http://{advertised_host(self.cfg.engine_bind_host)}:{self.port}"

    def _check_device_memory(self) -> None:
        """vLLM claims vllm_gpu_memory_utilization of each device's total memory; refuse before
        launching when another process (a trainer awake beside it) leaves less than that free."""
        wanted = self.cfg.vllm_gpu_memory_utilization
        short = [
            f"device {i}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB"
            for i, (free, total) in free_and_total(self.device_ids).items()
            if free < wanted * total
        ]
        if short:
            raise DeviceMemoryError(
                f"{self.name}: vllm_gpu_memory_utilization={wanted} asks for {wanted:.0%} of each device, but "
                f"{'; '.join(short)} (other processes hold the rest: lower the setting, or start engines "
                f"before the trainer / with the trainer asleep)"
            )

    def _attach(self) -> str:
        client = self.client()
        if not client.is_healthy(timeout_s=10.0):
            raise EngineStartError(
                f"engine_urls[{self.engine_index}]={redact_url(self.url or '')} does not answer /health"
            )
        world = client.world_size()
        if world != self.cfg.rollout_num_gpus_per_engine:
            raise ValueError(
                f"engine_urls[{self.engine_index}]={redact_url(self.url or '')} runs with TP x PP = {world}, "
                f"but rollout_num_gpus_per_engine={self.cfg.rollout_num_gpus_per_engine}"
            )
        return self.url  # type: ignore[return-value]

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def startup_marks(self) -> dict[str, Any]:
        """Where the server's last start went, from its log (`startup_log`); empty when attached."""
        if self.log_path is None or not self.log_path.exists():
            return {}
        return startup_marks(self.log_path.read_text(errors="replace"))

    def _wait_healthy(self, timeout_s: float) -> None:
        client = SyncEngineClient(self.url, self.name, token=self.auth_token)  # type: ignore[arg-type]

        def healthy() -> bool:
            code = self._proc.poll() if self._proc else None
            if code is not None:
                raise EngineStartError(
                    f"{self.name}: vLLM server exited with code {code} before becoming healthy; "
                    f"last {LOG_TAIL_LINES} log lines ({self.log_path}):\n{self.log_tail()}"
                )
            return client.is_healthy(timeout_s=2.0)

        if poll_until(healthy, timeout_s, interval_s=0.5):
            logger.info(
                "%s: healthy at %s (seconds from launch: %s)", self.name, self.url, describe(self.startup_marks())
            )
            return
        tail = self.log_tail()
        self._terminate(grace_s=5.0)
        raise EngineStartError(
            f"{self.name}: not healthy after engine_startup_timeout_s={timeout_s} s; "
            f"last {LOG_TAIL_LINES} log lines ({self.log_path}):\n{tail}"
        )

    def _warm_up(self) -> None:
        """One 1-token request: the first generate after start pays one-off set-up costs
        (seconds on CPU) that would otherwise land in the first rollout's timings."""
        import httpx

        body = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "temperature": 0.0}}
        try:
            resp = httpx.post(
                f"{self.url}/inference/v1/generate", json=body, headers=auth_headers(self.auth_token), timeout=120.0
            )
        except httpx.HTTPError as exc:
            logger.warning("%s: warm-up request failed: %s", self.name, exc)
            return
        if resp.status_code >= 400:  # e.g. 401: a second key asked by vllm_extra_args' --api-key
            logger.warning("%s: warm-up request answered HTTP %d: %s", self.name, resp.status_code, resp.text[:300])

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Abort in-flight requests (SIGTERM alone hangs while requests run), then SIGTERM, then
        SIGKILL after `grace_s`. Attached servers are not ours to stop."""
        if self._proc is None:
            return
        if self._proc.poll() is None and self.url:
            try:
                SyncEngineClient(self.url, self.name, control_timeout_s=5.0, token=self.auth_token).pause("abort")
            except Exception as exc:  # the server may already be broken; terminate anyway
                logger.info("%s: pause(abort) before shutdown failed: %s", self.name, exc)
        self._terminate(grace_s)

    def _terminate(self, grace_s: float) -> None:
        proc = self._proc
        if proc is None:
            return
        terminate_group(proc, grace_s, self.name)
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL without warning (tests of failure handling)."""
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._proc.wait(timeout=30)

    def restart(self) -> str:
        """Shut down and start again, on the same port when it is still free; the URL."""
        if self.attach_url:
            raise RuntimeError(
                f"{self.name} is attached to {redact_url(self.attach_url)}; it cannot be restarted from here"
            )
        self.shutdown()
        if self.port and not port_is_free(self.cfg.engine_bind_host, self.port):
            self.port = None
        return self.start()
