"""HTTP client of one vLLM server: token-in/token-out generate (async, aiohttp: the rollout's hot path)
and every control call of the step, also blocking through `SyncEngineClient`. Every failure is an
`EngineError` naming the engine, endpoint, status and a body excerpt. Every request carries the run's
token when the client has one. Control calls never go through vllm-router (it sends them to one
worker and drops the query string)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json as jsonlib
import logging
import uuid
from typing import Any, Callable, Coroutine, Iterable, Literal, Optional, TypeVar

import aiohttp

from vime_core.engines.auth import EngineToken, auth_headers
from vime_core.engines.vllm_api import VERSION_RPC_GET, VERSION_RPC_SET, VllmApi
from vime_core.utils.errors import InfrastructureError
from vime_core.utils.retry import async_attempts
from vime_core.utils.secrets import redact_url

logger = logging.getLogger(__name__)

# vLLM's answer to /start_weight_update while a session is open (its workers' error text)
STALE_SESSION = "weight update is already active"

PauseMode = Literal["abort", "wait", "keep"]
WAKE_TAGS = ("weights", "kv_cache")
_TAG_ALIASES = {"weights": "weights", "weight": "weights", "kv_cache": "kv_cache", "kv": "kv_cache"}
BODY_EXCERPT_CHARS = 500
GENERATE_PATH = "/inference/v1/generate"
# Key added to every generate answer: the client that got it ("engine-0 at http://..."), so that
# a problem found in the answer later (e.g. log-probs it lacks) can name the engine; through
# vllm-router it names the router, which does not say which worker answered.
ANSWERED_BY = "vime_answered_by"
# Key added to a generate answer whose request named a model (`model`, a LoRA adapter's name with
# lora_publish=adapter: engines/adapters.py): the name, which fixes the weights that generated it.
ASKED_MODEL = "vime_model"
# sampling param that asks for routed experts (vLLM's own name, per request, since 0.26): the rows
# from this prompt position on; an engine without native capture hands them over through vime's
# worker extension (vllm_side/routing_capture.py)
ROUTED_EXPERTS_START = "routed_experts_prompt_start"
ARM_CAPTURE_RPC = "vime_arm_routing_capture"
TAKE_ROUTED_EXPERTS_RPC = "vime_take_routed_experts"

T = TypeVar("T")


class EngineError(RuntimeError, InfrastructureError):
    """A vLLM server call that failed: which engine, which endpoint, what it answered."""

    def __init__(self, engine: str, endpoint: str, status: Optional[int], body: str) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self.status = status
        self.body = body[:BODY_EXCERPT_CHARS]
        super().__init__(f"engine {engine}: {endpoint} failed ({answer_label(status)}): {self.body}")

    def __reduce__(self):  # crosses Ray (pickle) with its own arguments, not the message
        return type(self), (self.engine, self.endpoint, self.status, self.body)


def answer_label(status: Optional[int]) -> str:
    """How an engine's answer is named in messages: `HTTP 500`, or `no answer`."""
    return f"HTTP {status}" if status is not None else "no answer"


def engine_answer(exc: BaseException) -> tuple[Optional[int], str]:
    """(HTTP status or None, what the engine answered) of a failed call: an EngineError's own
    status and body, without the engine's name and path that its message already carries."""
    if isinstance(exc, EngineError):
        return exc.status, exc.body
    return None, f"{type(exc).__name__}: {exc}"


class PrefixCacheBusy(EngineError):
    """vLLM refused to flush the prefix cache (blocks held by running requests), every time."""


class EngineWakeError(EngineError):
    """An engine did not wake. vLLM maps an engine's memory back allocation by allocation and a
    second wake maps every allocation again, so an engine whose wake failed part-way (out of
    device memory) cannot wake any more: it is restarted, then given the trainer's weights, before
    it serves again (EngineFleet._wake, HealthMonitor.condemn)."""

    def __init__(self, engine: str, tags: Iterable[str], status: Optional[int], why: str) -> None:
        self.tags = list(tags)
        self.why = why
        super().__init__(
            engine,
            f"POST /wake_up?tags={','.join(self.tags)}",
            status,
            f"{why} (the engine is restarted and given the trainer's weights before it serves again)",
        )

    def __reduce__(self):
        return type(self), (self.engine, self.tags, self.status, self.why)


def normalize_wake_tags(tags: Optional[Iterable[str]]) -> list[str]:
    """Tags vLLM knows (`weights`, `kv_cache`), deduplicated in canonical order; None -> both."""
    if tags is None:
        return list(WAKE_TAGS)
    if isinstance(tags, str):
        tags = [tags]
    wanted = set()
    for tag in tags:
        canonical = _TAG_ALIASES.get(str(tag).strip().lower())
        if canonical is None:
            raise ValueError(f"wake_up tag {tag!r} is not one of {list(WAKE_TAGS)}")
        wanted.add(canonical)
    return [t for t in WAKE_TAGS if t in wanted]


def parse_weight_version(raw: Any) -> int:
    """vLLM reports versions as strings; the checkpoint's own weights are "default" (version 0)."""
    if raw is None or raw == "default":
        return 0
    try:
        return int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"weight version {raw!r} is not an integer") from None


class EngineClient:
    """Async client of one vLLM server at `base_url` (e.g. http://127.0.0.1:8000).

    The underlying aiohttp session is bound to the event loop that first used it; a call from a
    different loop opens a fresh one. aiohttp rather than httpx: on the default job's many short
    requests httpx spent several times aiohttp's client CPU, which the engine on the same cores
    needs too.
    """

    def __init__(
        self,
        base_url: str,
        name: Optional[str] = None,
        timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        supports_sleep: bool = True,
        model: Optional[str] = None,
        max_connections: int = 1024,
        api: Optional[VllmApi] = None,
        token: Optional[EngineToken] = None,
        capture_peers: Optional[list["EngineClient"]] = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or redact_url(self.base_url)
        self.token = token  # sent with every request (module docstring); may be replaced later
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.supports_sleep = supports_sleep
        self.model = model
        self.max_connections = max_connections
        self._http: Optional[aiohttp.ClientSession] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._api: Optional[VllmApi] = api
        self._capture_armed = False
        # For a client of vllm-router: the engines behind it (a live list: a restarted engine's new
        # client replaces its old one). The router does not say which engine answered, so routed
        # experts are armed on and taken from each of them; an engine holds rows only of its own requests.
        self.capture_peers = capture_peers
        # takes of routed experts waiting for the next /collective_rpc: {request id: (start, future)}
        self._takes: dict[str, tuple[int, asyncio.Future]] = {}
        self._take_flush: Optional[asyncio.Task] = None

    # ---- plumbing ---------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop or self._http.closed:
            # keep-alive for every connection the rollout's concurrency opens; no proxies from
            # the environment (engines are on loopback or an internal network)
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
            self._http = aiohttp.ClientSession(base_url=self.base_url, connector=connector, trust_env=False)
            self._loop = loop
        return self._http

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.close()
        self._http = None
        self._loop = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Any = None,
        json: Any = None,
        headers: Optional[dict] = None,
        timeout_s: Optional[float] = None,
    ) -> Any:
        """One call; the decoded JSON body (None when empty). Raises `EngineError`."""
        endpoint = f"{method} {path}"
        timeout = timeout_s if timeout_s is not None else self.control_timeout_s
        headers = {**(headers or {}), **auth_headers(self.token)}
        try:
            async with self._client().request(
                method,
                path,
                params=params,
                json=json,
                headers=headers or None,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                status, content = resp.status, await resp.read()
        except (asyncio.TimeoutError, TimeoutError) as exc:
            raise EngineError(
                self.name, endpoint, None, f"timed out after {timeout} s ({type(exc).__name__})"
            ) from None
        except aiohttp.ClientError as exc:
            raise EngineError(self.name, endpoint, None, f"{type(exc).__name__}: {exc}") from None
        if status >= 400:
            raise EngineError(self.name, endpoint, status, content.decode("utf-8", errors="replace"))
        if not content:
            return None
        try:
            return jsonlib.loads(content)
        except ValueError:
            raise EngineError(
                self.name, endpoint, status, f"not JSON: {content.decode('utf-8', errors='replace')}"
            ) from None

    # ---- generation -------------------------------------------------------------------------

    async def generate(
        self,
        token_ids: list[int],
        sampling_params: dict,
        session_id: Optional[str] = None,
        request_id: Optional[str] = None,
        model: Optional[str] = None,
    ) -> dict:
        """`POST /inference/v1/generate`: token ids in; the raw response (choices with token_ids,
        logprobs, finish_reason, weight_versions; usage) out, plus `ANSWERED_BY`: this client's
        `label`, and `ASKED_MODEL` when the request named a model (`model`, else this client's).
        `session_id` travels in `X-Session-ID` (vllm-router's consistent_hash key)."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "sampling_params": sampling_params}
        model = model or self.model
        if model:
            body["model"] = model
        routing_from = sampling_params.get(ROUTED_EXPERTS_START)
        if routing_from is not None:
            request_id = request_id or uuid.uuid4().hex
            await self.arm_routing_capture()
        if request_id:
            body["request_id"] = request_id
        headers = {"X-Session-ID": session_id} if session_id else None
        answer = await self.request("POST", GENERATE_PATH, json=body, headers=headers, timeout_s=self.timeout_s)
        if routing_from is not None and isinstance(answer, dict):
            await self._add_captured_routing(answer, str(request_id), int(routing_from))
        if isinstance(answer, dict):
            answer[ANSWERED_BY] = self.label
            if model:
                answer[ASKED_MODEL] = model
        return answer

    async def arm_routing_capture(self) -> Optional[dict]:
        """Make the engine's workers capture routed experts (once per client; a restarted engine is
        armed again by `_add_captured_routing`): the layout {"layers", "top_k", "dtype"}, or {"native": True}
        when vLLM returns them itself (the choices then carry them). A router's client arms its peers."""
        if self.capture_peers is not None:
            layouts = await asyncio.gather(*(peer.arm_routing_capture() for peer in self.capture_peers))
            return next((layout for layout in layouts if layout is not None), None)
        if self._capture_armed:
            return None
        layouts = await self.collective_rpc(ARM_CAPTURE_RPC) or [None]
        self._capture_armed = True
        return layouts[0]

    async def _add_captured_routing(self, answer: dict, request_id: str, start: int) -> None:
        """Put the worker's rows of `request_id` into each choice without `routed_experts` (a native
        capture fills it; one choice per vime request)."""
        choices = answer.get("choices") or []
        if not choices or all(c.get("routed_experts") is not None for c in choices):
            return
        endpoint = f"POST /collective_rpc {TAKE_ROUTED_EXPERTS_RPC}"
        rows = await self._take_rows(request_id, start)
        if rows is None:
            if not any(c.get("token_ids") for c in choices):
                return  # nothing forwarded yet (aborted before its first step): no rows
            for holder in self._capture_holders():  # a restarted engine's workers: armed again on the next request
                holder._capture_armed = False
            raise EngineError(self.name, endpoint, None, f"no routed experts captured for request {request_id}")
        for choice in choices:
            choice["routed_experts"] = rows

    async def _take_rows(self, request_id: str, start: int) -> Optional[str]:
        """The worker's rows of one request; the takes that wait together go in one RPC (an RPC
        runs between engine steps: one per answer would stall a busy engine)."""
        future = asyncio.get_running_loop().create_future()
        self._takes[request_id] = (start, future)
        if self._take_flush is None or self._take_flush.done():
            self._take_flush = asyncio.ensure_future(self._flush_takes())
        return await future

    def _capture_holders(self) -> list["EngineClient"]:
        """The clients whose engines hold this client's captured rows: the router's peers, or itself."""
        return list(self.capture_peers) if self.capture_peers is not None else [self]

    async def _flush_takes(self) -> None:
        await asyncio.sleep(0)  # answers that arrived together join the first RPC
        while self._takes:
            waiting, self._takes = self._takes, {}
            asked = {"request_ids": list(waiting), "prompt_starts": [start for start, _ in waiting.values()]}
            rows, error = await self._take_from_holders(asked)
            for request_id, (_, future) in waiting.items():
                if future.done():
                    continue
                if request_id in rows or error is None:
                    future.set_result(rows.get(request_id))
                else:  # its engine may be the one that failed to answer
                    future.set_exception(error)

    async def _take_from_holders(self, asked: dict) -> tuple[dict[str, str], Optional[BaseException]]:
        """One take RPC to each holder, together: the rows found ({request id: rows}) and the first
        holder's error, if any failed. TP ranks route the same tokens: each engine's rank 0 rows."""
        answers = await asyncio.gather(
            *(holder.collective_rpc(TAKE_ROUTED_EXPERTS_RPC, asked) for holder in self._capture_holders()),
            return_exceptions=True,
        )
        rows: dict[str, str] = {}
        error: Optional[BaseException] = None
        for answer in answers:
            if isinstance(answer, BaseException):
                error = error or answer
                continue
            rows.update((request_id, r) for request_id, r in (answer or [{}])[0].items() if r is not None)
        return rows, error

    @property
    def label(self) -> str:
        """The engine in messages: its name and URL (`engine-0 at http://127.0.0.1:8000`), or the URL."""
        url = redact_url(self.base_url)
        return self.name if self.name == url else f"{self.name} at {url}"

    # ---- admission: pause / resume / abort ----------------------------------------------------

    async def pause(self, mode: PauseMode = "abort") -> dict:
        """abort: drop in-flight requests; wait: let them finish; keep: freeze them until resume."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause mode {mode!r} is not one of abort, wait, keep")
        return await self.request("POST", "/pause", params={"mode": mode})

    async def resume(self) -> dict:
        return await self.request("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self.request("GET", "/is_paused"))["is_paused"])

    async def abort_requests(self, request_ids: Optional[list[str]] = None) -> int:
        """Abort the given requests (all in flight when None) without pausing; how many."""
        body = {"request_ids": list(request_ids)} if request_ids else {}
        answer = await self.request("POST", "/abort_requests", json=body)
        return int((answer or {}).get("aborted", 0))

    # ---- memory: sleep / wake --------------------------------------------------------------

    async def sleep(self, level: int = 1, mode: PauseMode = "keep") -> dict:
        """Free device memory: level 1 offloads weights to host and drops the KV cache, level 2
        drops both (for engines that receive weights afterwards). Skipped, with a log line, where
        the platform has no sleep mode (vLLM CPU answers but frees nothing and stays paused)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level {level} is not 1 or 2")
        if not self.supports_sleep:
            logger.info("engine %s: no sleep mode on this platform; sleep(level=%d) skipped", self.name, level)
            return {"status": "skipped", "level": level}
        return await self.request("POST", "/sleep", params={"level": level, "mode": mode})

    async def wake_up(self, tags: Optional[Iterable[str]] = None) -> dict:
        """Wake the given parts (`weights`, `kv_cache`; None: both)."""
        canonical = normalize_wake_tags(tags)
        if not self.supports_sleep:
            logger.info("engine %s: no sleep mode on this platform; wake_up(%s) skipped", self.name, canonical)
            return {"status": "skipped", "tags": canonical}
        return await self.request("POST", "/wake_up", params=[("tags", t) for t in canonical])

    async def is_sleeping(self) -> bool:
        """Any part (weights, KV cache) asleep; False where the platform has no sleep mode."""
        if not self.supports_sleep:
            return False
        return bool((await self.request("GET", "/is_sleeping"))["is_sleeping"])

    async def reset_prefix_cache(self, attempts: int = 20, backoff_s: float = 0.05) -> None:
        """Flush the prefix cache (reloaded weights do not invalidate it). vLLM refuses while
        blocks are held by running requests, so retry up to `attempts` times, waiting
        min(backoff_s * 2^(n-1), 1 s) after refusal n (`vime_core/utils/retry`)."""

        async def flush() -> None:
            answer = await self.request("POST", "/reset_prefix_cache")
            if answer is not None and not answer.get("success", True):
                raise PrefixCacheBusy(
                    self.name, "POST /reset_prefix_cache", 200, f"still refused after {attempts} attempts"
                )

        await async_attempts(attempts, backoff_s, max_s=1.0, retry_on=lambda exc: isinstance(exc, PrefixCacheBusy))(
            flush
        )

    # ---- weights ----------------------------------------------------------------------------

    async def init_weight_transfer(self, init_info: dict) -> dict:
        return await self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    async def start_weight_update(self) -> dict:
        """Open an update session. A session left open by a publisher that died mid-publish (its
        process killed) would refuse every later one: it is closed first, with no weights, so
        the engine keeps the layers it had (the publish that follows sends every tensor)."""
        try:
            return await self.request("POST", "/start_weight_update")
        except EngineError as exc:
            if STALE_SESSION not in exc.body:
                raise
        logger.warning("%s: a weight update session left open by an earlier publish; closing it", self.name)
        await self.request("POST", "/finish_weight_update", json={})
        return await self.request("POST", "/start_weight_update")

    async def update_weights(self, update_info: dict) -> dict:
        return await self.request("POST", "/update_weights", json={"update_info": update_info})

    async def finish_weight_update(self, version: int | str) -> dict:
        """Close the update session; the engine reports `version` from now on (vllm_api: on
        releases without server-side versions vime sets it in the engine's workers)."""
        if (await self.api()).server_versions:
            return await self.request("POST", "/finish_weight_update", json={"weight_version": str(version)})
        answer = await self.request("POST", "/finish_weight_update", json={})
        await self.collective_rpc(VERSION_RPC_SET, {"version": str(version)})
        return answer

    async def update_weight_version(self, version: int | str) -> dict:
        """Set the version label only (after weights were reloaded another way, e.g. from disk)."""
        if (await self.api()).server_versions:
            return await self.request("POST", "/update_weight_version", json={"new_version": str(version)})
        await self.collective_rpc(VERSION_RPC_SET, {"version": str(version)})
        return {"weight_version": str(version)}

    async def weight_version(self) -> int:
        if (await self.api()).server_versions:
            return parse_weight_version((await self.request("GET", "/weight_info"))["weight_version"])
        per_worker = await self.collective_rpc(VERSION_RPC_GET) or [None]
        versions = {parse_weight_version(v) for v in per_worker}
        if len(versions) != 1:
            raise EngineError(
                self.name, f"POST /collective_rpc {VERSION_RPC_GET}", 200, f"workers disagree: {sorted(versions)}"
            )
        return versions.pop()

    async def collective_rpc(
        self, method: str, kwargs: Optional[dict] = None, args: Optional[list] = None, timeout_s: Optional[float] = None
    ) -> Any:
        body: dict[str, Any] = {"method": method, "kwargs": kwargs or {}, "args": args or []}
        if timeout_s is not None:
            body["timeout"] = timeout_s
        answer = await self.request("POST", "/collective_rpc", json=body, timeout_s=timeout_s)
        return None if answer is None else answer.get("results")

    # ---- liveness and shape -----------------------------------------------------------------

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True when /health answers 200; raises `EngineError` otherwise."""
        await self.request("GET", "/health", timeout_s=timeout_s)
        return True

    async def is_healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return await self.health(timeout_s)
        except EngineError:
            return False

    async def api(self) -> VllmApi:
        """What this server's vLLM release supports (`GET /version`, asked once)."""
        if self._api is None:
            self._api = VllmApi.for_version((await self.request("GET", "/version"))["version"])
        return self._api

    async def world_size(self) -> int:
        """TP x PP of the server (data parallelism excluded)."""
        answer = await self.request("GET", "/get_world_size", params={"include_dp": "false"})
        return int(answer["world_size"])

    async def served_models(self) -> list[dict]:
        return list((await self.request("GET", "/v1/models"))["data"])


async def call_all(engines: Iterable["EngineClient"], method: str, *args: Any, **kwargs: Any) -> list[Any]:
    """Call `EngineClient.<method>` on every engine at once; the first failure raises."""
    return list(await asyncio.gather(*(getattr(e, method)(*args, **kwargs) for e in engines)))


async def which_asleep(engines: Iterable["EngineClient"]) -> list[int]:
    """The indices of the engines that are asleep (any part).

    An engine is asleep outside a step only when an iteration stopped between its offload_rollout
    and its onload_kv. Its weights are then stale or, after a level-2 sleep, gone, while it still
    reports its last version: whoever wakes it must publish to it whatever version it reports."""
    return [i for i, sleeping in enumerate(await call_all(engines, "is_sleeping")) if sleeping]


async def wake_each(engines: Iterable["EngineClient"], tags: Iterable[str]) -> list[Optional[Exception]]:
    """`wake_up(tags)` on every engine at once; each engine's failure, or None. Every call runs
    to its end, so one engine's failure neither hides another's nor leaves it unreported."""
    tags = list(tags)
    answers = await asyncio.gather(*(e.wake_up(tags) for e in engines), return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, Exception):
            raise answer  # a cancellation or an exit is not an engine's failure
    return [a if isinstance(a, Exception) else None for a in answers]


def run_blocking(make_coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from sync code, also when this thread already runs a loop
    (a Ray async actor): then in a helper thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()


class SyncEngineClient:
    """Blocking versions of `EngineClient`'s calls (`SyncEngineClient(url).pause("keep")`), with
    the same names, signatures and docstrings (generated below from `EngineClient`, so the two
    never drift apart); each call opens and closes its own connection, which costs little and
    keeps the object free of event-loop state."""

    def __init__(self, base_url: str, name: Optional[str] = None, **client_kwargs: Any) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or redact_url(self.base_url)
        self._client_kwargs = client_kwargs


def _blocking(method: str) -> Callable[..., Any]:
    """`EngineClient.<method>` as a blocking `SyncEngineClient` method: one fresh client per call,
    run to completion by `run_blocking`."""

    @functools.wraps(getattr(EngineClient, method))
    def blocking(self: SyncEngineClient, *args: Any, **kwargs: Any) -> Any:
        async def one_call() -> Any:
            async with EngineClient(self.base_url, self.name, **self._client_kwargs) as client:
                return await getattr(client, method)(*args, **kwargs)

        return run_blocking(one_call)

    blocking.__qualname__ = f"SyncEngineClient.{method}"
    return blocking


for _method, _fn in list(vars(EngineClient).items()):  # every public coroutine but aclose
    if not _method.startswith("_") and _method != "aclose" and inspect.iscoroutinefunction(_fn):
        setattr(SyncEngineClient, _method, _blocking(_method))
del _method, _fn
