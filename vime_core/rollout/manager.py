"""RolloutManager: the rollout half of a run in one plain class (the cluster module makes it a
detached Ray actor). It owns the engines (or attaches to `engine_urls`), the router, the data
source and the reward hub, and runs every rollout on one long-lived event loop (its own thread),
so the HTTP connections to the engines and the router stay open between rollouts.

Phases it serves (design section 1): rollout (`generate`, `eval`), offload rollout (`offload`),
the engine side of sync (`begin_sync` = versions + pause admission + URLs, `onload_weights`,
`end_sync` = resume admission + start the next rollout, `onload_kv`).
Weight pushes themselves go from the trainer straight to `engine_urls()`.

Prefetch: `start_generate(k, v)` starts rollout k in a background thread once the engines hold
weights v, and `generate(k, v)` returns that result. The iteration flow starts rollout k+1 as
soon as iteration k has synced (and saved), so the rollout runs while Prefect closes flow run k
and opens k+1 instead of after it; one step off-policy (async_staleness), as soon as rollout k
ended. A prefetched rollout is used only for the same rollout id and a weight version at most
async_staleness behind the one asked for (`usable_prefetch`); anything else waits for it, puts
the data source back to where it was before it, and generates afresh. A checkpoint taken while one is pending records that earlier
data-source state, so resuming from it repeats the prefetched prompts, never skips them. A
rollout that fails (or whose batch cannot be trained on) puts the data source back to where it
was before it, too: its prompts are drawn again, never skipped.

Re-asked: the last rollout's result is kept until another rollout starts, and `generate(k, v)`
for that same id and version returns it again instead of generating new samples. The iteration
flow stores a batch while the trainer trains on it; if the store fails and the iteration is
re-run, the trainer (which already trained rollout k) skips it and the batch stored is the one
it trained on. Calls of `generate` run one at a time (a lock): a retried rollout task that asks
while its first try's call still runs gets that call's result, not a second rollout; the
trainer may already be training on an earlier result (the iteration flow submits training
on the batch's reference as soon as the rollout task returns).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from vime_core.engines.auth import EngineToken
from vime_core.engines.client import EngineClient
from vime_core.utils.loop_thread import LoopThread
from vime_core.utils.retry import poll_until

logger = logging.getLogger(__name__)


@dataclass
class _Prefetched:
    rollout_id: int
    version: Optional[int]
    future: concurrent.futures.Future
    data_source_before: dict


class RolloutManager:
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
        """`servers`: EngineServer objects already started by the caller (tests share them; the
        caller shuts them down). `engine_actors`: EngineServer actors placed on their devices
        (`cluster.run_actors`), started and watched here. Otherwise engine processes are
        started here, or attached when cfg.engine_urls is set. `on_engine_restarted(index, url)` must give a restarted engine
        the current weights (the trainer's publisher); without it a restarted engine serves the
        checkpoint's weights, and a warning says so. `token`: the run's engine token, sent with
        every request and kept for later drivers (`engine_token`); None: the one `servers` (or
        `engine_actors`) were started with, else a new one for the engines started here
        (engine_auth), else the environment's VIME_ENGINE_TOKEN for engine_urls (engines/auth.py)."""
        from vime_core.config import num_engines
        from vime_core.config.derive import platform_supports_sleep
        from vime_core.data.data_source import DataSource, load_tokenizer
        from vime_core.engines.health import HealthMonitor
        from vime_core.engines.server import EngineServer
        from vime_core.rewards.filters import load_filter
        from vime_core.rewards.hub import RewardHub
        from vime_core.rollout.generate import generate_sample
        from vime_core.rollout.loop import RolloutState
        from vime_core.utils.imports import load_function

        self.cfg = cfg
        self.token = _engine_token(cfg, token, servers, engine_actors)
        self.receives_weight_updates = receives_weight_updates
        self.on_engine_restarted = on_engine_restarted
        self.supports_sleep = platform_supports_sleep(cfg)
        self.tokenizer = load_tokenizer(cfg)
        self.data_source = DataSource(cfg, tokenizer=self.tokenizer)
        # the eval set is read and checked now, before the engines start, so that a bad row stops
        # the run at its start rather than at its first evaluation (and is not read again per eval)
        self._eval_rows = self._load_eval_rows() if cfg.eval_interval and cfg.eval_prompt_data else None
        self.reward_hub = RewardHub(cfg)
        self.rollout_fn = load_function(cfg.rollout_function_path, field="rollout_function_path")
        generate_fn = (
            load_function(cfg.custom_generate_function_path, field="custom_generate_function_path")
            if cfg.custom_generate_function_path else generate_sample
        )
        group_filter = load_filter(cfg.dynamic_sampling_filter_path)
        self.admission_open = threading.Event()
        self.admission_open.set()

        self._owns_servers = servers is None
        self._loop = LoopThread("rollout-loop")
        self._prefetch_lock = threading.Lock()
        self._generate_lock = threading.Lock()  # generate calls one at a time (module docstring)
        self._prefetched: Optional[_Prefetched] = None
        self._last: Optional[tuple[int, Optional[int], tuple[dict, dict]]] = None  # (id, version, result)
        self._prefetch_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
        if servers is not None:
            self.servers = list(servers)
        elif engine_actors:
            from vime_core.engines.remote import RemoteEngine

            self.servers = [RemoteEngine(a, i) for i, a in enumerate(engine_actors)]
        elif cfg.engine_urls:
            if len(cfg.engine_urls) != num_engines(cfg):
                logger.info("engine_urls lists %d engines; the configuration implies %d; using the URLs", len(cfg.engine_urls), num_engines(cfg))
            self.servers = [EngineServer(cfg, i, attach_url=u, log_dir=log_dir, token=self.token)
                            for i, u in enumerate(cfg.engine_urls)]
        else:
            self.servers = [EngineServer(cfg, i, log_dir=log_dir, token=self.token) for i in range(num_engines(cfg))]
        self.router = None
        self._startup_epochs: dict[str, float] = {}
        try:
            self._start_servers_and_router(log_dir)
            self._startup_epochs["engines_started"] = time.time()
            self._connect_router()
            self._startup_epochs["router_ready"] = time.time()
        except BaseException:
            self.shutdown()
            raise

        self.state = RolloutState(
            cfg=cfg, data_source=self.data_source, reward_hub=self.reward_hub,
            generator=self._generator, engines=self._engine_clients, tokenizer=self.tokenizer,
            group_filter=group_filter, eos_token_id=self.tokenizer.eos_token_id, generate_fn=generate_fn,
            admission_open=self.admission_open, concurrency=cfg.vllm_server_concurrency * len(self.servers),
        )
        self.health = HealthMonitor(self.servers, on_restarted=self._engine_restarted, on_url_changed=self._url_changed, interval_s=health_interval_s)
        self.health.start()
        self._startup_epochs["ready"] = time.time()

    # ---- topology ----------------------------------------------------------------------------

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
        failed = [(server, start.exception()) for server, start in zip(self.servers, starts) if start.exception() is not None]
        if failed:
            (server, first), *others = failed
            if server.name not in str(first):
                first.add_note(f"while starting {server.name}")
            for server, err in others:
                first.add_note(f"{server.name} failed to start as well: {type(err).__name__}: {err}")
            raise first

    def _start_servers_and_router(self, log_dir: Optional[str]) -> None:
        """The engines (when this manager owns them) and, with use_router, vllm-router with no
        workers yet, side by side: the router's own start is then off the startup's path. A
        router that fails is logged; its error is raised unless an engine's is."""
        if not self.cfg.use_router:
            if self._owns_servers:
                self._start_servers()
            return
        from vime_core.engines.router import Router

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
        from vime_core.engines.router import PolicyRouter

        urls = self.engine_urls()
        self._engine_clients = [self._client(u, f"engine-{i}") for i, u in enumerate(urls)]
        if self.router is not None:
            for url in urls:
                self.router.add_worker(url)
            self._wait_router_workers(self.router, urls)
            self._generator = self._client(self.router.url, "router")
            return
        self._generator = PolicyRouter(self._engine_clients, self.cfg.router_policy, seed=self.cfg.seed)

    @staticmethod
    def _wait_router_workers(router: Any, urls: list[str], timeout_s: float = 60.0) -> None:
        if not poll_until(lambda: not set(urls) - set(router.workers()), timeout_s, interval_s=0.2):
            raise RuntimeError(f"vllm-router did not register {sorted(set(urls) - set(router.workers()))} within {timeout_s} s:\n{router.log_tail()}")

    def _client(self, url: str, name: str) -> EngineClient:
        return EngineClient(url, name, supports_sleep=self.supports_sleep, token=self.token,
                            max_connections=max(64, self.cfg.vllm_server_concurrency * 2))

    def engine_token(self) -> Optional[EngineToken]:
        """The run's engine token, for whoever attaches to this actor later (the trainer's publisher,
        a new flow run: vime_core/cluster/engine_token.py). Through Ray only."""
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
        for i, client in enumerate(self._engine_clients):
            if client.base_url == old_url:
                self._engine_clients[i] = fresh = self._client(new_url, client.name)
                self._loop.submit(client.aclose())
                if self.router is None:
                    self._generator.add(fresh)
                    self._generator.remove(old_url)
        if self.router is not None:
            try:
                self.router.remove_worker(old_url)
            except Exception as exc:
                logger.info("router remove_worker %s: %s", old_url, exc)
            self.router.add_worker(new_url)

    def engine_urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def startup_epochs(self) -> dict[str, float]:
        """When this manager's start reached each step, as epochs: every engine started
        (`engines_started`), the router in front of them (`router_ready`), the manager's own
        state and health monitor (`ready`)."""
        return dict(self._startup_epochs)

    def engine_startup_marks(self) -> list[dict[str, Any]]:
        """Each engine's last start from its log (launched_epoch, seconds from the launch to
        vLLM's milestones: engines/startup_log.py); empty for an attached one."""
        return [s.startup_marks() for s in self.servers]

    def _each_engine(self, method: str, *args: Any) -> list[Any]:
        """A control call on every engine directly, concurrently."""
        from vime_core.engines.client import call_all

        return self._loop.run(call_all(self._engine_clients, method, *args))

    # ---- rollout -----------------------------------------------------------------------------

    def generate(self, rollout_id: int, version: Optional[int] = None) -> tuple[dict, dict]:
        """One rollout: `(build_batch(samples), metrics)`; the prefetched one when it was started
        for this rollout id and weight version, or the last one again when it is asked for twice
        (module docstring). Opens admission (it stays closed after a run's last sync)."""
        with self._generate_lock:
            return self._generate_once(rollout_id, version)

    def _generate_once(self, rollout_id: int, version: Optional[int]) -> tuple[dict, dict]:
        self.resume_admission()
        last = self._last
        if last is not None and version is not None and last[:2] == (rollout_id, version):
            batch, metrics = last[2]
            return batch, {**metrics, "rollout/reused": 1.0}
        with self._prefetch_lock:
            pending, self._prefetched = self._prefetched, None
        result = None
        if pending is not None and usable_prefetch(pending.rollout_id, pending.version, rollout_id, version,
                                                   self.cfg.async_staleness):
            t0 = time.perf_counter()
            result = pending.future.result()
            result[1]["rollout/prefetched"] = 1.0
            result[1]["rollout/time_prefetch_wait_s"] = time.perf_counter() - t0
        elif pending is not None:
            self._drop(pending, restore=True)
        if result is None:
            result = self._generate_now(rollout_id, version)
        self._last = (rollout_id, version, result)
        return result

    def start_generate(self, rollout_id: int, version: Optional[int] = None) -> bool:
        """Start rollout `rollout_id` in the background with the engines' current weights
        (`version`); False when another prefetched rollout is still unclaimed. Opens admission."""
        self.resume_admission()
        with self._prefetch_lock:
            if self._prefetched is not None:
                return False
            before = self.data_source.state_dict()
            future = self._prefetch_pool.submit(self._generate_now, rollout_id, version)
            self._prefetched = _Prefetched(rollout_id, version, future, before)
            return True

    def prefetched(self) -> Optional[tuple[int, Optional[int]]]:
        """(rollout id, weight version) of the started and not yet claimed rollout, or None."""
        with self._prefetch_lock:
            pending = self._prefetched
        return None if pending is None else (pending.rollout_id, pending.version)

    def discard_prefetch(self, restore_data_source: bool = True) -> None:
        with self._prefetch_lock:
            pending, self._prefetched = self._prefetched, None
        if pending is not None:
            self._drop(pending, restore_data_source)

    def _drop(self, pending: _Prefetched, restore: bool) -> None:
        try:  # it uses the data source and the engines: let it end first
            pending.future.result()
        except Exception as exc:
            logger.info("prefetched rollout %d ended with %s", pending.rollout_id, exc)
        if restore:
            self.data_source.load_state_dict(pending.data_source_before)
        logger.warning("discarded the prefetched rollout %d (weights v%s)", pending.rollout_id, pending.version)

    def _generate_now(self, rollout_id: int, version: Optional[int] = None) -> tuple[dict, dict]:
        from vime_core.config.derive import rollout_logprob_readers
        from vime_core.data.batch import build_batch, weight_version_range
        from vime_core.data.validation import validate_trainable

        self._last = None  # a new rollout: the previous result is no longer asked for
        self.state.weight_version = version

        before = self.data_source.state_dict()
        try:
            samples, metrics = self.generate_samples(rollout_id)
            t0 = time.perf_counter()
            batch = build_batch(samples, self.cfg)
            # the trainer's own check, before the batch goes anywhere: nothing untrainable is stored
            # (a custom rollout function may hand on samples the default loop would have retried)
            validate_trainable(batch, log_prob_readers=rollout_logprob_readers(self.cfg))
        except BaseException:
            # A failed rollout hands nothing on: its prompts go back, so a retry, or the run
            # resumed after a fix, draws them again instead of skipping them (this manager lives
            # on across the iteration's retries and a run's restart: tasks/bootstrap.py).
            self.data_source.load_state_dict(before)
            raise
        metrics["rollout/time_build_s"] = time.perf_counter() - t0
        metrics.update({f"rollout/{k}": v for k, v in weight_version_range(batch).items()})
        metrics["rollout/engine_restarts"] = float(self.health.restarts)
        # where the data source stands after this rollout: stored with the batch (its lineage),
        # so a run resumed past its checkpoint continues from the last stored batch's prompts
        from vime_core.storage.schema import DATA_SOURCE_AFTER

        metrics[DATA_SOURCE_AFTER] = self.data_source.state_dict()
        return batch, metrics

    def generate_samples(self, rollout_id: int) -> tuple[list, dict]:
        """The rollout function's raw output (samples, metrics), for tests and custom drivers."""
        self.health.resume()
        return self._loop.run(self.rollout_fn(self.state, rollout_id))

    def _clients(self) -> list[Any]:
        generators = getattr(self, "_generator", None)
        return [*getattr(self, "_engine_clients", []), *getattr(generators, "clients", [generators] if generators else [])]

    def _load_eval_rows(self) -> list:
        """eval_prompt_data's rows, checked as the training prompts are (vime_core/data/prompt_checks.py)."""
        from vime_core.data.data_source import load_prompt_rows

        split = self.cfg.eval_prompt_data_split or self.cfg.prompt_data_split
        return load_prompt_rows(self.cfg.eval_prompt_data, self.cfg, self.tokenizer, split)

    def eval(self, rollout_id: int) -> dict:
        """Eval rollout over cfg.eval_prompt_data; metrics only. The training data is untouched."""
        from vime_core.rollout.eval import run_eval

        if not self.cfg.eval_prompt_data:
            raise ValueError("eval_prompt_data is empty: nothing to evaluate")
        if self._eval_rows is None:
            self._eval_rows = self._load_eval_rows()
        rows = self._eval_rows
        self.health.resume()
        # The last iteration's sync leaves admission held (no rollout follows it), and its eval
        # comes after that sync: the eval's own requests go through, and the hold is restored.
        held = not self.admission_open.is_set()
        self.admission_open.set()
        try:
            _, metrics = self._loop.run(run_eval(self.state, rows, rollout_id))
        finally:
            if held:
                self.admission_open.clear()
        return metrics

    # ---- offload / onload / admission ----------------------------------------------------------

    def offload(self) -> list[dict]:
        """Engines sleep: level 2 (drop weights too) when the trainer will push new ones, else 1.
        Returns each engine's device memory afterwards (as the wake calls do)."""
        self.health.pause()
        self._each_engine("sleep", 2 if self.receives_weight_updates else 1, "keep")
        return self.engine_memory()

    def wake_asleep_engines(self) -> list[str]:
        """Engines a stopped iteration left asleep wake their weights; their names (bootstrap
        publishes to them: vime_core.engines.client.which_asleep)."""
        from vime_core.engines.client import which_asleep

        asleep = self._loop.run(which_asleep(self._engine_clients))
        self._wake(["weights"], asleep)
        return [self._engine_clients[i].name for i in asleep]

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
        from vime_core.engines.client import EngineWakeError, answer_label, engine_answer, wake_each

        indices = range(len(self._engine_clients)) if indices is None else indices
        clients = [self._engine_clients[i] for i in indices]
        for i, client in zip(indices, clients):
            if (why := self.health.condemned(i)) is not None:
                raise EngineWakeError(client.name, tags, None, f"not tried again before its restart: {why}")
        failed = [(i, c, exc) for i, c, exc in zip(indices, clients, self._loop.run(wake_each(clients, tags))) if exc is not None]
        for i, client, exc in failed:
            logger.error("%s did not wake %s: %s", client.name, tags, exc)
            status, answer = engine_answer(exc)
            self.health.condemn(i, f"wake_up({','.join(tags)}) failed ({answer_label(status)}): {answer}")
        if failed:
            i, client, exc = failed[0]
            raise EngineWakeError(client.name, tags, *engine_answer(exc)) from exc

    def probe_log_probs(self, tokens: list[int]) -> tuple[list[list[float]], Optional[list[list[float]]]]:
        """Every engine's log-probs of the probe `tokens` (positions 1..n-1, temperature 1), and
        the previous call's answer (check_weight_update_equal; vime_core/weight_sync/weight_check)."""
        from vime_core.weight_sync.weight_check import prompt_logprobs_of

        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}

        async def all_engines() -> list[dict]:
            return list(await asyncio.gather(*(c.generate(tokens, params) for c in self._engine_clients)))

        now = [prompt_logprobs_of(answer, tokens) for answer in self._loop.run(all_engines())]
        previous, self._last_probe = getattr(self, "_last_probe", None), now
        return now, previous

    def engine_memory(self) -> list[dict]:
        """Device memory of every engine (`EngineServer.memory`); empty dicts on CPU."""
        return [s.memory() for s in self.servers]

    def pause_admission(self) -> None:
        """Hold new generate requests (those in flight continue) until resume_admission."""
        self.admission_open.clear()

    def resume_admission(self) -> None:
        self.admission_open.set()

    def begin_sync(self, target_version: int, force: bool = False) -> Optional[list[str]]:
        """The engine side of sync's start, in one actor call: None when every engine already
        reports `target_version` (nothing to publish) and not `force`, else admission paused and
        the engines' URLs to publish to (tasks.sync.publish)."""
        versions = self.weight_versions()
        if not force and versions and all(v == target_version for v in versions):
            return None
        self.pause_admission()
        return self.engine_urls()

    def end_sync(self, resume: bool = True, start_rollout_id: Optional[int] = None,
                 version: Optional[int] = None, *published: Any) -> bool:
        """Sync's end, in one actor call: when `start_rollout_id` is given, that rollout started
        on weights `version` (start_generate, which opens admission); else admission resumed
        unless `resume` is False (after a run's last sync). True when a rollout was started.

        `published` is not read: the sync task passes the trainer ranks' `update_weights`
        references there, top-level arguments that Ray resolves before it runs a call, so this
        call runs the moment the publish ends (and not at all when it fails; tasks.sync)."""
        if start_rollout_id is not None:
            return self.start_generate(start_rollout_id, version)  # which opens admission
        if resume:
            self.resume_admission()
        return False

    def weight_versions(self) -> list[int]:
        return self._each_engine("weight_version")

    def check_engines(self) -> int:
        """Restart every dead or condemned engine now (also while engines sleep), or wait for the
        restart the health monitor is running (a restarted engine gets the trainer's weights
        first); how many this call restarted. Raises EngineError when a condemned engine is
        still not restarted (its restart failed, or it is attached and not ours to restart)."""
        from vime_core.engines.client import EngineError

        health = getattr(self, "health", None)
        if health is None:
            return 0
        restarted = health.check_now(even_paused=True)
        if stuck := health.condemned_engines():
            i, why = min(stuck.items())
            restart = health.restart_errors.get(i, "it is attached (engine_urls): restart it, then run again")
            # the restart's own error first: EngineError keeps only the first BODY_EXCERPT_CHARS
            raise EngineError(self._engine_clients[i].name, "restart", None, f"{restart} (it was to be restarted: {why})")
        return restarted

    # ---- state -------------------------------------------------------------------------------

    def data_source_state(self) -> dict:
        """The data source's state; while a prefetched rollout is unclaimed, the state before it."""
        with self._prefetch_lock:
            pending = self._prefetched
        return pending.data_source_before if pending is not None else self.data_source.state_dict()

    def load_data_source_state(self, state: dict) -> None:
        self.discard_prefetch(restore_data_source=False)
        self.data_source.load_state_dict(state)

    def shutdown(self) -> None:
        health = getattr(self, "health", None)
        if health is not None:
            health.stop()
        pool = getattr(self, "_prefetch_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        loop = getattr(self, "_loop", None)
        if loop is not None:
            try:
                loop.run(_close_all(self._clients()))
            except Exception as exc:
                logger.info("closing engine connections: %s", exc)
            loop.close()
        if getattr(self, "router", None) is not None:
            self.router.shutdown()
            self.router = None
        if self._owns_servers:
            for server in getattr(self, "servers", []):
                try:
                    server.shutdown()
                except Exception as exc:
                    logger.warning("shutting down %s: %s", getattr(server, "name", server), exc)


def _engine_token(cfg: Any, token: Optional[EngineToken], servers: Optional[Sequence[Any]],
                  engine_actors: Optional[Sequence[Any]]) -> Optional[EngineToken]:
    """The token this manager sends (RolloutManager's `token` argument)."""
    if token is not None:
        return token
    if servers:
        return getattr(servers[0], "auth_token", None)
    if engine_actors:  # the engines' own (they make one when created without it)
        import ray

        return ray.get(engine_actors[0].engine_token.remote())
    if cfg.engine_urls:
        return EngineToken.from_env()
    return EngineToken.new() if cfg.engine_auth else None


def usable_prefetch(started_id: int, started_version: Optional[int], rollout_id: int, version: Optional[int],
                    staleness: int = 0) -> bool:
    """Whether a rollout started as (`started_id`, `started_version`) answers a request for
    (`rollout_id`, `version`): the same rollout id, on weights v with version - staleness <= v <=
    version (exactly `version` when on-policy; None matches only None)."""
    if started_id != rollout_id:
        return False
    if version is None or started_version is None:
        return started_version == version
    return version - staleness <= started_version <= version


async def _close_all(clients: list[Any]) -> None:
    """Close engine clients. A module function, not a method: one coroutine method would make Ray
    run RolloutManager as an asyncio actor, whose calls all share one event-loop thread (its
    max_concurrency then counts coroutines), instead of the threaded actor it is written as."""
    await asyncio.gather(*(c.aclose() for c in clients), return_exceptions=True)
