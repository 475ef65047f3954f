"""Request routing in front of the engines for generate calls: `Router` runs the real vllm-router on a
free loopback port (consistent_hash keys on X-Session-ID); `PolicyRouter` is the in-client fallback
(use_router=False) with the same policies. Control calls go to each engine directly (the router
sends them to one worker and drops their query string)."""

from __future__ import annotations

import bisect
import hashlib
import itertools
import importlib.util
import logging
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import httpx

from vime_core.engines.client import EngineClient
from vime_core.utils.secrets import redact_url
from vime_core.engines.server import REPO_ROOT
from vime_core.utils.errors import InfrastructureError
from vime_core.utils.orphan_guard import guard_command
from vime_core.utils.processes import free_port, log_tail, terminate_group
from vime_core.utils.retry import poll_until

logger = logging.getLogger(__name__)

# Lowered from the router's defaults (slow startup polls, minutes to notice a dead worker), so
# a killed engine is taken out and a restarted one comes back quickly.
FAST_HEALTH_ARGS = (
    "--worker-startup-check-interval",
    "1",
    "--health-check-interval-secs",
    "2",
    "--health-failure-threshold",
    "2",
    "--cb-timeout-duration-secs",
    "10",
)


def router_command() -> list[str]:
    """`vllm-router` beside the running interpreter (the trainer environment's bin/), else its
    entry point run by this interpreter (a site folder unpacked with `pip --target`, as on the
    GPU host, has no usable console script: its shebang names the machine that built it)."""
    candidate = Path(sys.executable).parent / "vllm-router"
    if candidate.exists():
        return [str(candidate)]
    fallback = REPO_ROOT / ".venv" / "bin" / "vllm-router"
    if fallback.exists():
        return [str(fallback)]
    if importlib.util.find_spec("vllm_router") is not None:
        return [
            sys.executable,
            "-c",
            "import sys; from vllm_router.launch_router import main; sys.argv[0] = 'vllm-router'; sys.exit(main())",
        ]
    raise FileNotFoundError(
        f"vllm-router not found next to {sys.executable} nor at {fallback} (pip install vllm-router)"
    )


class RouterError(RuntimeError, InfrastructureError):
    pass


class Router:
    """The real vllm-router on 127.0.0.1 (never another address: below), in front of
    `worker_urls` (more can be added later).

    vllm-router asks nothing of inbound requests and sends no key to workers, so it binds 127.0.0.1
    whatever engine_bind_host says (its only caller is the RolloutManager on the same node). It holds
    no token: it forwards the caller's Authorization header and the engines check it. Its own routes
    (/add_worker, ...) are open to local users of the node (docs/gpus-and-clusters.md)."""

    def __init__(
        self,
        policy: str = "consistent_hash",
        worker_urls: Sequence[str] = (),
        log_dir: Optional[str] = None,
        startup_timeout_s: float = 60.0,
        request_timeout_s: int = 1800,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.policy = policy
        self.initial_workers = [u.rstrip("/") for u in worker_urls]
        self.log_dir = Path(log_dir) if log_dir else REPO_ROOT / ".cache" / "engine-logs"
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.extra_args = list(extra_args)
        self.port: Optional[int] = None
        self.prometheus_port: Optional[int] = None
        self.url: Optional[str] = None
        self.log_path: Optional[Path] = None
        self._proc: Optional[subprocess.Popen] = None
        self._log_file = None

    def command(self) -> list[str]:
        cmd = [
            *router_command(),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.prometheus_port),
            "--policy",
            self.policy,
            "--request-timeout-secs",
            str(self.request_timeout_s),
            "--log-level",
            "warning",
            *FAST_HEALTH_ARGS,
        ]
        if self.initial_workers:
            cmd += ["--worker-urls", *self.initial_workers]
        return cmd + self.extra_args

    def start(self) -> str:
        self.port, self.prometheus_port = free_port(), free_port()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"router-{os.getpid()}-{self.port}.log"
        self._log_file = open(self.log_path, "ab")
        cmd = self.command()
        logger.info("router: starting %s", " ".join(cmd))
        self._proc = subprocess.Popen(  # under the guard: it dies with this process (utils/orphan_guard.py)
            guard_command(cmd),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"

        def live() -> bool:
            if self._proc.poll() is not None:
                raise RouterError(f"vllm-router exited with code {self._proc.returncode}:\n{self.log_tail()}")
            try:
                return httpx.get(f"{self.url}/liveness", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        if poll_until(live, self.startup_timeout_s, interval_s=0.2):
            return self.url
        self.shutdown()
        raise RouterError(f"vllm-router not live after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def _post(self, path: str, url: str, timeout_s: float) -> None:
        try:
            resp = httpx.post(f"{self.url}{path}", params={"url": url}, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise RouterError(f"router {path} {redact_url(url)}: {type(exc).__name__}: {exc}") from None
        if resp.status_code >= 400:
            raise RouterError(f"router {path} {redact_url(url)}: HTTP {resp.status_code}: {resp.text[:300]}")

    def add_worker(self, url: str, timeout_s: float = 120.0) -> None:
        """Register an engine; the router answers once it has seen the worker healthy."""
        self._post("/add_worker", url.rstrip("/"), timeout_s)

    def remove_worker(self, url: str, timeout_s: float = 30.0) -> None:
        self._post("/remove_worker", url.rstrip("/"), timeout_s)

    def workers(self) -> list[str]:
        answer = httpx.get(f"{self.url}/list_workers", timeout=10.0).json()
        return [u.rstrip("/") for u in answer.get("urls", [])]

    def shutdown(self, grace_s: float = 5.0) -> None:
        proc = self._proc
        if proc is None:
            return
        terminate_group(proc, grace_s, "vllm-router")
        self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None


def _hash64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class PolicyRouter:
    """In-client routing over `EngineClient`s with vllm-router's policy names.

    consistent_hash: a hash ring with `virtual_nodes` points per engine; a session id maps to
    the first point clockwise of hash(session id), so a session stays on one engine and removing
    an engine moves only that engine's sessions. Requests without a session id go round robin.
    """

    SUPPORTED = ("round_robin", "random", "consistent_hash")

    def __init__(
        self, clients: Sequence[EngineClient], policy: str = "consistent_hash", virtual_nodes: int = 64, seed: int = 0
    ) -> None:
        if policy not in self.SUPPORTED:
            logger.warning("in-client routing has no %r policy; using round_robin", policy)
            policy = "round_robin"
        if not clients:
            raise ValueError("PolicyRouter needs at least one engine")
        self.policy = policy
        self.virtual_nodes = virtual_nodes
        self._rng = random.Random(seed)
        self._clients: list[EngineClient] = []
        self._ring: list[tuple[int, int]] = []
        for client in clients:
            self.add(client)
        self._counter = itertools.count()

    @property
    def clients(self) -> list[EngineClient]:
        return list(self._clients)

    def _rebuild_ring(self) -> None:
        self._ring = sorted(
            (_hash64(f"{client.base_url}#{v}"), i)
            for i, client in enumerate(self._clients)
            for v in range(self.virtual_nodes)
        )

    def add(self, client: EngineClient) -> None:
        self._clients.append(client)
        self._rebuild_ring()

    def remove(self, base_url: str) -> None:
        self._clients = [c for c in self._clients if c.base_url != base_url.rstrip("/")]
        if not self._clients:
            raise ValueError("PolicyRouter would have no engine left")
        self._rebuild_ring()

    def pick(self, session_id: Optional[str] = None) -> EngineClient:
        if self.policy == "consistent_hash" and session_id:
            point = bisect.bisect_left(self._ring, (_hash64(session_id), -1)) % len(self._ring)
            return self._clients[self._ring[point][1]]
        if self.policy == "random":
            return self._rng.choice(self._clients)
        return self._clients[next(self._counter) % len(self._clients)]

    async def generate(
        self,
        token_ids: list[int],
        sampling_params: dict,
        session_id: Optional[str] = None,
        request_id: Optional[str] = None,
    ) -> dict:
        return await self.pick(session_id).generate(
            token_ids, sampling_params, session_id=session_id, request_id=request_id
        )
