"""The engine token: the middleware vLLM loads refuses every request without the run's
token (called here as the ASGI app it is, in-process); the token never shows in a repr, a
command line, a stored configuration or the exception of a failed request (a canary searched for
in each). The configuration's refusal: test_engine_auth_config.py; the real vLLM server and
router: tests/integration/rollout/test_engine_auth.py."""

from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from tests.unit.test_rollout_client import FakeEngine
from vime_core.engines.auth import MIDDLEWARE, OPEN_HEALTH_ENV, TOKEN_ENV, EngineToken, auth_headers
from vime_core.engines.client import EngineClient, EngineError
from vime_core.engines.vllm_side.auth import EngineAuthMiddleware

CANARY = "canary-Zq8vT3xL0pW9-engine-token"


# ---- the middleware, as vLLM calls it ----------------------------------------------------------


def _call(middleware: EngineAuthMiddleware, scope: dict) -> tuple[list[dict], bool]:
    """(messages the middleware sent, whether it let the request through to the app)."""
    reached, sent = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"] if "path" in scope else scope["type"])

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        sent.append(message)

    middleware.app = app
    asyncio.run(middleware(scope, receive, send))
    return sent, bool(reached)


def _http(path: str, method: str = "POST", *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": list(headers), "query_string": b""}


@pytest.fixture
def middleware(monkeypatch) -> EngineAuthMiddleware:
    monkeypatch.setenv(TOKEN_ENV, CANARY)
    monkeypatch.delenv(OPEN_HEALTH_ENV, raising=False)
    return EngineAuthMiddleware(app=None)  # type: ignore[arg-type]


ROUTES = [
    "/inference/v1/generate",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/collective_rpc",
    "/sleep",
    "/wake_up",
    "/pause",
    "/resume",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/metrics",
    "/invocations",
    "/ping",
    "/openapi.json",
    "/version",
    "/is_paused",
]
BAD_HEADERS = {
    "none": [],
    "wrong token": [(b"authorization", b"Bearer not-the-token")],
    "token with a suffix": [(b"authorization", f"Bearer {CANARY}x".encode())],
    "basic scheme": [(b"authorization", f"Basic {CANARY}".encode())],
    "bare token": [(b"authorization", CANARY.encode())],
    "two headers": [(b"authorization", f"Bearer {CANARY}".encode()), (b"authorization", b"Bearer x")],
    "another header": [(b"x-api-key", CANARY.encode())],
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_every_route_without_the_token_is_refused_before_vllm(middleware, route, case):
    sent, reached = _call(middleware, _http(route, "GET" if route == "/health" else "POST", *BAD_HEADERS[case]))
    assert not reached
    assert sent[0]["status"] == 401 and (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    assert CANARY.encode() not in sent[1]["body"] and b"token" in sent[1]["body"]


@pytest.mark.parametrize("route", ROUTES)
def test_the_token_lets_every_route_through(middleware, route):
    sent, reached = _call(middleware, _http(route, "POST", (b"Authorization", f"Bearer {CANARY}".encode())))
    assert reached and sent == []


def test_health_is_open_only_for_router_runs_and_only_to_reads(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, CANARY)
    monkeypatch.setenv(OPEN_HEALTH_ENV, "1")
    open_health = EngineAuthMiddleware(app=None)  # type: ignore[arg-type]
    assert _call(open_health, _http("/health", "GET"))[1] and _call(open_health, _http("/health", "HEAD"))[1]
    assert not _call(open_health, _http("/health", "POST"))[1]
    assert not _call(open_health, _http("/health/x", "GET"))[1] and not _call(open_health, _http("/pause", "GET"))[1]


def test_lifespan_passes_and_a_websocket_is_closed(middleware):
    assert _call(middleware, {"type": "lifespan"})[1]
    sent, reached = _call(middleware, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert not reached and sent == [{"type": "websocket.close", "code": 1008}]


def test_no_token_in_the_environment_no_server(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(RuntimeError, match=f"{TOKEN_ENV} is not set"):
        EngineAuthMiddleware(app=None)  # type: ignore[arg-type]


# ---- the token on the sending side -------------------------------------------------------------


def test_the_token_shows_only_through_reveal():
    token = EngineToken(CANARY)
    for text in (
        repr(token),
        str(token),
        f"{token}",
        f"{token!r}",
        "%s" % token,
        json.dumps({"t": str(token)}),
        repr({"token": token}),
        repr([token]),
    ):
        assert CANARY not in text
    assert token.reveal() == CANARY and auth_headers(token) == {"Authorization": f"Bearer {CANARY}"}
    assert pickle.loads(pickle.dumps(token)) == token != EngineToken.new()  # crosses Ray whole
    assert auth_headers(None) == {}
    new = EngineToken.new().reveal()
    assert len(new) >= 43 and new != EngineToken.new().reveal()  # 32 random bytes, base64url
    with pytest.raises(ValueError) as err:
        EngineToken("has a space " + CANARY)
    assert CANARY not in str(err.value)


def _failed_call(url: str, token: EngineToken) -> EngineError:
    async def call():
        async with EngineClient(url, "e0", token=token, control_timeout_s=5) as client:
            await client.pause("keep")

    with pytest.raises(EngineError) as err:
        asyncio.run(call())
    return err.value


def test_a_failed_request_sends_the_token_and_its_error_does_not_hold_it():
    echo = f"you sent Authorization: Bearer {CANARY}"  # even an engine that echoes it...
    with FakeEngine(lambda m, p, b: (401, {"error": "Unauthorized"})) as fake:
        refused = _failed_call(fake.url, EngineToken(CANARY))
        assert fake.requests[0][3]["Authorization"] == f"Bearer {CANARY}"
    assert refused.status == 401
    with FakeEngine(lambda m, p, b: (500, {"detail": echo[:20]})) as fake:
        failed = _failed_call(fake.url, EngineToken(CANARY))
    from vime_core.engines.server import free_port

    unreachable = _failed_call(f"http://127.0.0.1:{free_port()}", EngineToken(CANARY))
    for err in (refused, failed, unreachable):
        assert CANARY not in f"{err} {err!r} {err.body} {pickle.loads(pickle.dumps(err))}"


def _cfg(**values):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values

    return make_config(demo_values({"device": "cpu", **values}))


def test_the_token_is_in_the_engine_environment_only(tiny_model_dir):
    from vime_core.config.loader import config_dict
    from vime_core.engines.server import EngineServer

    cfg = _cfg(hf_checkpoint=str(tiny_model_dir))
    server = EngineServer(cfg, 0, token=EngineToken(CANARY))
    cmd = server.command(4321)
    assert cmd[cmd.index("--middleware") + 1] == MIDDLEWARE and CANARY not in " ".join(cmd)
    env = server.environment()
    assert env[TOKEN_ENV] == CANARY and env[OPEN_HEALTH_ENV] == "1"  # use_router: health open for the router
    assert (
        OPEN_HEALTH_ENV not in EngineServer(_cfg(hf_checkpoint=str(tiny_model_dir), use_router=False), 0).environment()
    )
    assert CANARY not in json.dumps(config_dict(cfg)) and CANARY not in repr(vars(server))
    own = EngineServer(cfg, 1)  # none given: a token of its own
    assert own.auth_token is not None and own.auth_token != server.auth_token
    off = EngineServer(_cfg(hf_checkpoint=str(tiny_model_dir), engine_auth=False), 0, token=EngineToken(CANARY))
    assert off.auth_token is None and "--middleware" not in off.command(4321) and TOKEN_ENV not in off.environment()


def test_engine_urls_take_the_users_token_from_the_environment_and_store_none(monkeypatch):
    from vime_core.config.loader import config_dict

    monkeypatch.setenv(TOKEN_ENV, CANARY)
    cfg = _cfg(engine_urls=["http://10.0.0.9:8000"])
    assert EngineToken.from_env() == EngineToken(CANARY)
    assert CANARY not in json.dumps(config_dict(cfg)) and CANARY not in cfg.model_dump_json()
    monkeypatch.delenv(TOKEN_ENV)
    assert EngineToken.from_env() is None
