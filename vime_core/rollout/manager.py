"""RolloutManager: the rollout half of a run in one plain class (the cluster module makes it a
detached Ray actor). It owns the data source and the reward hub, runs generation, prefetch and
evaluation, and holds the engines as an EngineFleet (`self.fleet`, vime_core/engines/fleet.py:
topology, router, sleep and wake, versions, admission, health, the engine token), whose calls
it delegates one line each so its Ray interface stays whole. Every rollout runs on the fleet's
long-lived event loop, so the HTTP connections to the engines and the router stay open.

Phases it serves: rollout (`generate`, `eval`), offload rollout (`offload`), the engine side of
sync (`begin_sync` = versions + pause admission + URLs, `onload_weights`, `end_sync` = resume
admission or start the next rollout, `onload_kv`). The publish itself goes from the
trainer straight to `engine_urls()`.

Prefetch: `start_generate(k, v)` starts rollout k in a background thread once the engines hold
weights v, and `generate(k, v)` returns that result. The iteration flow starts rollout k+1 as
soon as iteration k has synced (and saved), so the rollout runs while Prefect closes flow run k
and opens k+1 instead of after it; one step off-policy (async_staleness), as soon as rollout k
ended. A prefetched rollout is used only for the same rollout id and a weight version at most
async_staleness behind the one asked for (`usable_prefetch`); anything else waits for it, puts
the data source back to where it was before it, and generates afresh. A checkpoint taken
while one is pending records that earlier data-source state, so resuming from it repeats the
prefetched prompts, never skips them. A
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

from vime_core.config.derive import rollout_logprob_readers
from vime_core.data.batch import build_batch, weight_version_range
from vime_core.data.data_source import DataSource, load_prompt_rows, load_tokenizer
from vime_core.data.validation import validate_trainable
from vime_core.engines.auth import EngineToken
from vime_core.engines.fleet import EngineFleet
from vime_core.rewards.filters import load_filter
from vime_core.rewards.hub import RewardHub
from vime_core.rollout.eval import run_eval
from vime_core.rollout.generate import generate_sample
from vime_core.rollout.loop import RolloutState
from vime_core.storage.schema import DATA_SOURCE_AFTER
from vime_core.utils.imports import load_function
from vime_core.weight_sync.weight_check import prompt_logprobs_of

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
        started here, or attached when cfg.engine_urls is set (all through `self.fleet`:
        vime_core/engines/fleet.py). `on_engine_restarted(index, url)` must give a restarted engine
        the current weights (the trainer's publisher); without it a restarted engine serves the
        checkpoint's weights, and a warning says so. `token`: the run's engine token, sent with
        every request and kept for later drivers (`engine_token`); None: the one `servers` (or
        `engine_actors`) were started with, else a new one for the engines started here
        (engine_auth), else the environment's VIME_ENGINE_TOKEN for engine_urls (engines/auth.py)."""
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg)
        self.data_source = DataSource(cfg, tokenizer=self.tokenizer)
        # the eval set is read and checked now, before the engines start, so that a bad row stops
        # the run at its start rather than at its first evaluation (and is not read again per eval)
        self._eval_rows = self._load_eval_rows() if cfg.eval_interval and cfg.eval_prompt_data else None
        self.reward_hub = RewardHub(cfg)
        self.rollout_fn = load_function(cfg.rollout_function_path, field="rollout_function_path")
        generate_fn = (
            load_function(cfg.custom_generate_function_path, field="custom_generate_function_path")
            if cfg.custom_generate_function_path
            else generate_sample
        )
        group_filter = load_filter(cfg.dynamic_sampling_filter_path)

        self._prefetch_lock = threading.Lock()
        self._generate_lock = threading.Lock()  # generate calls one at a time (module docstring)
        self._prefetched: Optional[_Prefetched] = None
        self._last: Optional[tuple[int, Optional[int], tuple[dict, dict]]] = None  # (id, version, result)
        self._prefetch_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-prefetch")
        self.fleet = EngineFleet(
            cfg,
            servers=servers,
            engine_actors=engine_actors,
            receives_weight_updates=receives_weight_updates,
            on_engine_restarted=on_engine_restarted,
            health_interval_s=health_interval_s,
            log_dir=log_dir,
            token=token,
        )
        try:
            self.fleet.start(log_dir)
        except BaseException:
            self.shutdown()
            raise

        self.state = RolloutState(
            cfg=cfg,
            data_source=self.data_source,
            reward_hub=self.reward_hub,
            generator=self.fleet.generator,
            engines=self.fleet.clients,
            tokenizer=self.tokenizer,
            group_filter=group_filter,
            eos_token_id=self.tokenizer.eos_token_id,
            generate_fn=generate_fn,
            admission_open=self.fleet.admission_open,
            concurrency=cfg.vllm_server_concurrency * len(self.fleet.servers),
        )
        self.fleet.watch()

    # ---- the engines: the fleet's, delegated (vime_core/engines/fleet.py) --------------------

    def engine_token(self) -> Optional[EngineToken]:
        """The run's engine token, for whoever attaches to this actor later (the trainer's publisher,
        a new flow run: vime_core/cluster/engine_token.py). Through Ray only."""
        return self.fleet.engine_token()

    def engine_urls(self) -> list[str]:
        return self.fleet.engine_urls()

    def startup_epochs(self) -> dict[str, float]:
        """When this manager's start reached each step, as epochs (EngineFleet.startup_epochs)."""
        return self.fleet.startup_epochs()

    def engine_startup_marks(self) -> list[dict[str, Any]]:
        return self.fleet.engine_startup_marks()

    def offload(self) -> list[dict]:
        return self.fleet.offload()

    def wake_asleep_engines(self) -> list[str]:
        return self.fleet.wake_asleep_engines()

    def onload_weights(self) -> list[dict]:
        return self.fleet.onload_weights()

    def onload_kv(self) -> list[dict]:
        return self.fleet.onload_kv()

    def engine_memory(self) -> list[dict]:
        return self.fleet.engine_memory()

    def pause_admission(self) -> None:
        self.fleet.pause_admission()

    def resume_admission(self) -> None:
        self.fleet.resume_admission()

    def begin_sync(self, target_version: int, force: bool = False) -> Optional[list[str]]:
        return self.fleet.begin_sync(target_version, force)

    def weight_versions(self) -> list[int]:
        return self.fleet.weight_versions()

    def check_engines(self) -> int:
        return self.fleet.check_engines()

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
        if pending is not None and usable_prefetch(
            pending.rollout_id, pending.version, rollout_id, version, self.cfg.async_staleness
        ):
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
        metrics["rollout/engine_restarts"] = float(self.fleet.health.restarts)
        # where the data source stands after this rollout: stored with the batch (its lineage),
        # so a run resumed past its checkpoint continues from the last stored batch's prompts
        metrics[DATA_SOURCE_AFTER] = self.data_source.state_dict()
        return batch, metrics

    def generate_samples(self, rollout_id: int) -> tuple[list, dict]:
        """The rollout function's raw output (samples, metrics), for tests and custom drivers."""
        self.fleet.health.resume()
        return self.fleet.loop.run(self.rollout_fn(self.state, rollout_id))

    def _load_eval_rows(self) -> list:
        """eval_prompt_data's rows, checked as the training prompts are (vime_core/data/prompt_checks.py)."""
        split = self.cfg.eval_prompt_data_split or self.cfg.prompt_data_split
        return load_prompt_rows(self.cfg.eval_prompt_data, self.cfg, self.tokenizer, split)

    def eval(self, rollout_id: int) -> dict:
        """Eval rollout over cfg.eval_prompt_data; metrics only. The training data is untouched."""
        if not self.cfg.eval_prompt_data:
            raise ValueError("eval_prompt_data is empty: nothing to evaluate")
        if self._eval_rows is None:
            self._eval_rows = self._load_eval_rows()
        rows = self._eval_rows
        self.fleet.health.resume()
        # The last iteration's sync leaves admission held (no rollout follows it), and its eval
        # comes after that sync: the eval's own requests go through, and the hold is restored.
        with self.fleet.admitting():
            _, metrics = self.fleet.loop.run(run_eval(self.state, rows, rollout_id))
        return metrics

    def probe_log_probs(self, tokens: list[int]) -> tuple[list[list[float]], Optional[list[list[float]]]]:
        """Every engine's log-probs of the probe `tokens` (positions 1..n-1, temperature 1), and
        the previous call's answer (check_weight_update_equal; vime_core/weight_sync/weight_check)."""
        params = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        clients = self.fleet.clients

        async def all_engines() -> list[dict]:
            return list(await asyncio.gather(*(c.generate(tokens, params) for c in clients)))

        now = [prompt_logprobs_of(answer, tokens) for answer in self.fleet.loop.run(all_engines())]
        previous, self._last_probe = getattr(self, "_last_probe", None), now
        return now, previous

    def end_sync(
        self,
        resume: bool = True,
        start_rollout_id: Optional[int] = None,
        version: Optional[int] = None,
        *published: Any,
    ) -> bool:
        """Sync's end, in one actor call: when `start_rollout_id` is given, that rollout started
        on weights `version` (start_generate, which opens admission); else admission resumed
        unless `resume` is False (after a run's last sync). True when a rollout was started.

        `published` is not read: the sync task passes the trainer ranks' `publish`
        references there, top-level arguments that Ray resolves before it runs a call, so this
        call runs the moment the publish ends (and not at all when it fails; tasks.sync)."""
        if start_rollout_id is not None:
            return self.start_generate(start_rollout_id, version)  # which opens admission
        if resume:
            self.fleet.resume_admission()
        return False

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
        """Stop the prefetch pool, then the fleet (EngineFleet.shutdown)."""
        pool = getattr(self, "_prefetch_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        fleet = getattr(self, "fleet", None)  # None when the constructor failed before making it
        if fleet is not None:
            fleet.shutdown()


def usable_prefetch(
    started_id: int, started_version: Optional[int], rollout_id: int, version: Optional[int], staleness: int = 0
) -> bool:
    """Whether a rollout started as (`started_id`, `started_version`) answers a request for
    (`rollout_id`, `version`): the same rollout id, on weights v with version - staleness <= v <=
    version (exactly `version` when on-policy; None matches only None)."""
    if started_id != rollout_id:
        return False
    if version is None or started_version is None:
        return started_version == version
    return version - staleness <= started_version <= version
