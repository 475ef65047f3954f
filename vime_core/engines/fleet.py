"""EngineFleet: a run's vLLM engines as one thing, the engine half of the RolloutManager: topology
(servers, engine actors or attached URLs; the router; one client per engine), sleep and wake, weight
versions, admission, health and restarts, and the run's engine token. Its event loop holds every
engine connection, so they stay open between rollouts; the manager runs its rollouts on it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from typing import Any, Callable, Iterator, Optional, Sequence

from vime_core.config import num_engines
from vime_core.config.derive import platform_supports_sleep
from vime_core.engines.adapters import served_name, serves_adapters
from vime_core.engines.auth import EngineToken
from vime_core.engines.client import (
    EngineClient,
    EngineError,
    EngineWakeError,
    answer_label,
    call_all,
    engine_answer,
    wake_each,
    which_asleep,
)
from vime_core.engines.admission import SYNC, Admission
from vime_core.engines.health import HealthMonitor
from vime_core.engines.remote import RemoteEngine
from vime_core.engines.router import PolicyRouter, Router
from vime_core.engines.server import EngineServer
from vime_core.utils.loop_thread import LoopThread
from vime_core.utils.retry import poll_until
from vime_core.utils.secrets import redact_url

logger = logging.getLogger(__name__)


class EngineFleet:
    def __init__(
        self,
        cfg: Any,
        *,
        servers: Optional[Sequence[Any]] = None,
        engine_actors: Optional[Sequence[Any]] = None,
        receives_weight_updates: bool = True,
        on_engine_restarted: Optional[Callable[[int, str], None]] = None,
        health_interval_s: float = 2.0,
        log_dir: Optional[str] = None,
        token: Optional[EngineToken] = None,
    ) -> None:
        """The engines' handles and the loop, nothing started yet (`start`, then `watch`).
        The arguments are the RolloutManager's, which documents them."""
        self.cfg = cfg
        self.token = _engine_token(cfg, token, servers, engine_actors)
        self.receives_weight_updates = receives_weight_updates
        self.on_engine_restarted = on_engine_restarted
        self.health_interval_s = health_interval_s
        self.supports_sleep = platform_supports_sleep(cfg)
        self.admission_open = Admission()
        self._weights_stale = False  # the weight check found engines a publish did not reach
        self._owns_servers = servers is None
        self.loop = LoopThread("rollout-loop")
        if servers is not None:
            self.servers = list(servers)
        elif engine_actors:
            self.servers = [RemoteEngine(a, i) for i, a in enumerate(engine_actors)]
        elif cfg.engine_urls:
            if len(cfg.engine_urls) != num_engines(cfg):
                logger.info(
                    "engine_urls lists %d engines; the configuration implies %d; using the URLs",
                    len(cfg.engine_urls),
                    num_engines(cfg),
                )
            self.servers = [
                EngineServer(cfg, i, attach_url=u, log_dir=log_dir, token=self.token)
                for i, u in enumerate(cfg.engine_urls)
            ]
        else:
            self.servers = [EngineServer(cfg, i, log_dir=log_dir, token=self.token) for i in range(num_engines(cfg))]
        self.router: Optional[Router] = None
        self.health: Optional[HealthMonitor] = None
        self.clients: list[EngineClient] = []  # one per engine, in engine order; replaced in place on a new URL
        self.generator: Any = None  # where generate requests go: the router's client or a PolicyRouter
        # lora_publish=adapter: the engines serve the base weights and one adapter per version;
        # every generate request names the adapter of the version they hold (`serve_version`)
        self.serves_adapters = serves_adapters(cfg)
        self.served_model: Optional[str] = None
        self._startup_epochs: dict[str, float] = {}

    # ---- topology ----------------------------------------------------------------------------

    def start(self, log_dir: Optional[str]) -> None:
        """Start the engines (when owned) and the router, then connect clients and routing. On
        an error the caller shuts the fleet down."""
        self._start_servers_and_router(log_dir)
        self._startup_epochs["engines_started"] = time.time()
        self._connect_router()
        self._startup_epochs["router_ready"] = time.time()

    def watch(self) -> None:
        """Start the health monitor: the fleet is ready."""
        self.health = HealthMonitor(
            self.servers,
            on_restarted=self._engine_restarted,
            on_url_changed=self._url_changed,
            holding=lambda index: self.admission_open.held(f"restart of engine {index}"),
            interval_s=self.health_interval_s,
        )
        self.health.start()
        self._startup_epochs["ready"] = time.time()

    def _start_servers(self) -> None:
        """Start every engine at once and wait for all of them: a start is mostly waiting (a
        server loading its model, an engine actor's call), so N engines take about as long as
        the slowest, not the sum. Once every start has ended, the first failure in engine order
        is raised as it came, with notes naming its engine (where its message does not) and the
        other engines that failed; waiting for all first means the shutdown that follows never
        races a start still launching a server."""
        if len(self.servers) <= 1:
            for server in self.servers:
                server.start()
            return
        with concurrent.futures.ThreadPoolExecutor(len(self.servers), thread_name_prefix="engine-start") as pool:
            starts = [pool.submit(server.start) for server in self.servers]
        failed = [
            (server, start.exception()) for server, start in zip(self.servers, starts) if start.exception() is not None
        ]
        if failed:
            (server, first), *others = failed
            if server.name not in str(first):
                first.add_note(f"while starting {server.name}")
            for server, err in others:
                first.add_note(f"{server.name} failed to start as well: {type(err).__name__}: {err}")
            raise first

    def _start_servers_and_router(self, log_dir: Optional[str]) -> None:
        """The engines (when this fleet owns them) and, with use_router, vllm-router with no
        workers yet, side by side: the router's own start is then off the startup's path. A
        router that fails is logged; its error is raised unless an engine's is."""
        if not self.cfg.use_router:
            if self._owns_servers:
                self._start_servers()
            return
        router = Router(self.cfg.router_policy, log_dir=log_dir)
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="router-start") as pool:
            started = pool.submit(router.start)
            try:
                if self._owns_servers:
                    self._start_servers()
            finally:
                error = started.exception()  # the router's start waited for, either way
                if error is None:
                    self.router = router  # a failed engine start's shutdown stops it too
                else:
                    router.shutdown()
                    logger.warning("vllm-router failed to start: %s", error)
            if error is not None:  # reached only when the engines started
                raise error

    def _connect_router(self) -> None:
        """Clients for every engine; the router (started beside the engines) given them as its
        workers, or, without it, the in-client policy router."""
        urls = self.engine_urls()
        self.clients = [self._client(u, f"engine-{i}") for i, u in enumerate(urls)]
        if self.router is not None:
            for url in urls:
                self.router.add_worker(url)
            self._wait_router_workers(self.router, urls)
            # routed experts are taken from the engine that generated, which the router does not name
            self.generator = self._client(self.router.url, "router", capture_peers=self.clients)
            return
        self.generator = PolicyRouter(self.clients, self.cfg.router_policy, seed=self.cfg.seed)

    @staticmethod
    def _wait_router_workers(router: Any, urls: list[str], timeout_s: float = 60.0) -> None:
        if not poll_until(lambda: not set(urls) - set(router.workers()), timeout_s, interval_s=0.2):
            missing = sorted(redact_url(url) for url in set(urls) - set(router.workers()))
            raise RuntimeError(f"vllm-router did not register {missing} within {timeout_s} s:\n{router.log_tail()}")

    def _client(self, url: str, name: str, capture_peers: Optional[list[EngineClient]] = None) -> EngineClient:
        return EngineClient(
            url,
            name,
            capture_peers=capture_peers,
            supports_sleep=self.supports_sleep,
            token=self.token,
            max_connections=max(64, self.cfg.vllm_server_concurrency * 2),
            model=self.served_model,
        )

    def engine_token(self) -> Optional[EngineToken]:
        """The run's engine token, for whoever attaches to the RolloutManager later (the trainer's
        publisher, a new flow run: vime_core/cluster/engine_token.py). Through Ray only."""
        return self.token

    def _engine_restarted(self, index: int, url: str) -> None:
        if self.on_engine_restarted is not None:
            self.on_engine_restarted(index, url)
        else:
            logger.warning("engine %d restarted without a weight callback: it serves the checkpoint's weights", index)

    def _url_changed(self, old_url: str, new_url: str) -> None:
        """Point clients and routing at a restarted engine. On the same URL the router's own
        health check re-admits it; on a new one it is re-registered."""
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        if old_url == new_url:
            return
        for i, client in enumerate(self.clients):
            if client.base_url == old_url:
                self.clients[i] = fresh = self._client(new_url, client.name)
                self.loop.submit(client.aclose())
                if self.router is None:
                    self.generator.add(fresh)
                    self.generator.remove(old_url)
        if self.router is not None:
            try:
                self.router.remove_worker(old_url)
            except Exception as exc:
                logger.info("router remove_worker %s: %s", old_url, exc)
            self.router.add_worker(new_url)

    def engine_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def startup_epochs(self) -> dict[str, float]:
        """When the start reached each step, as epochs: every engine started (`engines_started`),
        the router in front of them (`router_ready`), the RolloutManager's own state and this
        fleet's health monitor (`ready`)."""
        return dict(self._startup_epochs)

    def engine_startup_marks(self) -> list[dict[str, Any]]:
        """Each engine's last start from its log (launched_epoch, seconds from the launch to
        vLLM's milestones: engines/startup_log.py); empty for an attached one."""
        return [s.startup_marks() for s in self.servers]

    def _each_engine(self, method: str, *args: Any) -> list[Any]:
        """A control call on every engine directly, concurrently."""
        return self.loop.run(call_all(self.clients, method, *args))

    # ---- offload / onload ----------------------------------------------------------------------

    def offload(self, keep_weights: bool = False) -> list[dict]:
        """Engines sleep: level 2 (drop weights too) when the trainer will publish new ones, else 1
        (also with lora_publish=adapter: a publish brings only the adapter, so the base weights
        must come back from the host; and with `keep_weights`: the weights they serve wake as they
        were, e.g. after a checkpoint). Returns each engine's device memory afterwards (as the
        wake calls do)."""
        self.health.pause()
        level = 2 if self.sleep_drops_weights() and not keep_weights else 1
        self._each_engine("sleep", level, "keep")
        return self.engine_memory()

    def sleep_drops_weights(self) -> bool:
        """The engines' sleep drops their weights (level 2): every publish brings all of them."""
        return self.receives_weight_updates and not self.serves_adapters

    def room_for_publish(self) -> bool:
        """Before a publish of every weight beside the trainer (bootstrap's, colocated): engines
        whose sleep drops their weights sleep and wake the weights only, as each iteration leaves
        them before its publish. The device then holds both copies of the weights but not the
        engines' KV cache, which onload_kv wakes after the publish. False (nothing done) where the
        engines keep their weights asleep or cannot sleep."""
        if not (self.supports_sleep and self.sleep_drops_weights()):
            return False
        self.offload()
        self.onload_weights()
        return True

    def wake_asleep_engines(self) -> list[str]:
        """Engines a stopped iteration left asleep wake their weights; their names (bootstrap
        publishes to them: vime_core.engines.client.which_asleep)."""
        asleep = self.loop.run(which_asleep(self.clients))
        self._wake(["weights"], asleep)
        return [self.clients[i].name for i in asleep]

    def onload_weights(self) -> list[dict]:
        self._wake(["weights"])
        return self.engine_memory()

    def onload_kv(self) -> list[dict]:
        self._wake(["kv_cache"])
        self.health.resume()
        return self.engine_memory()

    def _wake(self, tags: list[str], indices: Optional[Sequence[int]] = None) -> None:
        """`wake_up(tags)` on the engines `indices` (None: all), concurrently. An engine whose wake
        fails cannot wake again (EngineWakeError): it is condemned, check_engines restarts it,
        and no wake is tried on it before that. Raises the first engine's EngineWakeError after
        every engine's call ended."""
        indices = range(len(self.clients)) if indices is None else indices
        clients = [self.clients[i] for i in indices]
        for i, client in zip(indices, clients):
            if (why := self.health.condemned(i)) is not None:
                raise EngineWakeError(client.name, tags, None, f"not tried again before its restart: {why}")
        answers = self.loop.run(wake_each(clients, tags))
        failed = [(i, c, exc) for i, c, exc in zip(indices, clients, answers) if exc is not None]
        for i, client, exc in failed:
            logger.error("%s did not wake %s: %s", client.name, tags, exc)
            status, answer = engine_answer(exc)
            self.health.condemn(i, f"wake_up({','.join(tags)}) failed ({answer_label(status)}): {answer}")
        if failed:
            i, client, exc = failed[0]
            raise EngineWakeError(client.name, tags, *engine_answer(exc)) from exc

    def engine_memory(self) -> list[dict]:
        """Device memory of every engine (`EngineServer.memory`); empty dicts on CPU."""
        return [s.memory() for s in self.servers]

    # ---- admission and versions ----------------------------------------------------------------

    def pause_admission(self) -> None:
        """Hold new generate requests (those in flight continue) until resume_admission."""
        self.admission_open.hold(SYNC)

    def resume_admission(self) -> None:
        """Let go of pause_admission's hold (an engine restart may still hold admission)."""
        self.admission_open.release(SYNC)

    @contextlib.contextmanager
    def admitting(self) -> Iterator[None]:
        """Admission open inside the block, and held again after it if it was held before (an
        eval after a run's last sync, which leaves admission held: no rollout follows it)."""
        held = SYNC in self.admission_open.holders()
        self.admission_open.release(SYNC)
        try:
            yield
        finally:
            if held:
                self.admission_open.hold(SYNC)

    def begin_sync(self, target_version: int, force: bool = False) -> Optional[list[str]]:
        """The engine side of sync's start: None when every engine already reports
        `target_version` (nothing to publish) and neither `force` nor the stale mark is set, else
        admission paused and the engines' URLs to publish to (tasks.sync.publish)."""
        versions = self.weight_versions()
        if not (force or self._weights_stale) and versions and all(v == target_version for v in versions):
            return None
        self.pause_admission()
        return self.engine_urls()

    def mark_weights_stale(self) -> None:
        """The engines' weights are not the version they report (the weight check found them
        unchanged by a publish): `weight_versions` reports 0 for every engine and `begin_sync`
        publishes until a publish ends (`published`), so the next start (bootstrap) publishes the
        trainer's weights again."""
        self._weights_stale = True

    def published(self, version: int) -> None:
        """A publish of `version` ended: the engines hold what it sent (the stale mark goes) and
        generate requests name it (`serve_version`). Only here: `weight_versions` serving the
        version the engines agree on says nothing of whether their weights are that version."""
        self._weights_stale = False
        self.serve_version(version)

    def weight_versions(self) -> list[int]:
        """Every engine's version, or 0 for each while the stale mark is set; where they agree,
        generate requests name it from now on (`serve_version`: a fleet attached to engines that
        already hold adapters)."""
        if self._weights_stale:
            return [0] * len(self.clients)
        versions = self._each_engine("weight_version")
        if versions and len(set(versions)) == 1:
            self.serve_version(versions[0])
        return versions

    def serve_version(self, version: int) -> None:
        """Have every generate request name weights `version` from now on: with
        lora_publish=adapter its adapter (engines/adapters.py `served_name`); else a no-op, the
        engines serve what was published last. Called once a publish of `version` ended."""
        name = served_name(self.cfg, version)
        if name == self.served_model:
            return
        self.served_model = name
        for client in self._all_clients():
            client.model = name

    # ---- health --------------------------------------------------------------------------------

    def check_engines(self) -> int:
        """Restart every dead or condemned engine now (also while engines sleep), or wait for the
        restart the health monitor is running (a restarted engine gets the trainer's weights
        first); how many this call restarted. Raises EngineError when a condemned engine is
        still not restarted (its restart failed, or it is attached and not ours to restart)."""
        health = self.health
        if health is None:
            return 0
        restarted = health.check_now(even_paused=True)
        if stuck := health.condemned_engines():
            i, why = min(stuck.items())
            restart = health.restart_errors.get(i, "it is attached (engine_urls): restart it, then run again")
            # the restart's own error first: EngineError keeps only the first BODY_EXCERPT_CHARS
            raise EngineError(self.clients[i].name, "restart", None, f"{restart} (it was to be restarted: {why})")
        return restarted

    # ---- shutdown ------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the health monitor, close every connection and the loop, stop the router and the
        engines this fleet started (never those it was given)."""
        if self.health is not None:
            self.health.stop()
        try:
            self.loop.run(_close_all(self._all_clients()))
        except Exception as exc:
            logger.info("closing engine connections: %s", exc)
        self.loop.close()
        if self.router is not None:
            self.router.shutdown()
            self.router = None
        if self._owns_servers:
            for server in self.servers:
                try:
                    server.shutdown()
                except Exception as exc:
                    logger.warning("shutting down %s: %s", getattr(server, "name", server), exc)

    def _all_clients(self) -> list[Any]:
        generators = self.generator
        return [*self.clients, *getattr(generators, "clients", [generators] if generators else [])]


def _engine_token(
    cfg: Any, token: Optional[EngineToken], servers: Optional[Sequence[Any]], engine_actors: Optional[Sequence[Any]]
) -> Optional[EngineToken]:
    """The token the fleet sends (the RolloutManager's `token` argument)."""
    if token is not None:
        return token
    if servers:
        return getattr(servers[0], "auth_token", None)
    if engine_actors:  # the engines' own (they make one when created without it)
        import ray  # only where engine actors exist, as in engines/remote.py

        return ray.get(engine_actors[0].engine_token.remote())
    if cfg.engine_urls:
        return EngineToken.from_env()
    return EngineToken.new() if cfg.engine_auth else None


async def _close_all(clients: list[Any]) -> None:
    """Close engine clients. A module function, not a method: a coroutine method on the
    RolloutManager would make Ray run it as an asyncio actor (tests/unit/test_actor_classes.py);
    kept out of classes altogether so none grows one."""
    await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
