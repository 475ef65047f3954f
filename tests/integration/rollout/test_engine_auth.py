"""Attacks on the real vLLM server: a request without the run's token, or with a wrong one,
to each route family of a real vLLM CPU server started the way vime starts it (generate, the
OpenAI routes, health, /collective_rpc, sleep/wake/pause, the weight-update session, metrics and
the rest) is refused with 401 and changes nothing (not paused, same weight version, no session
left open, no request served); with the token every family works. Through the real vllm-router
likewise: test_router_auth.py. The token is in no log line and no engine log.

Two engines of the folder (use_router: GET /health open for the router's health checks) and one
of this module's own without the router (every route closed, /health too)."""

from __future__ import annotations

import asyncio
import logging
import re

import httpx
import pytest

from tests.integration.rollout.conftest import make_cfg
from vime_core.engines.auth import EngineToken, auth_headers
from vime_core.engines.client import EngineClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = [1, 5, 14, 6, 17]
SECRET_VERSION = "4242"  # what an unauthenticated caller tries to set
# (method, path, query, json body) per route family; each is refused without the token
ATTACKS = {
    "generate": [("POST", "/inference/v1/generate", None, {"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})],
    "openai": [
        ("POST", "/v1/completions", None, {"prompt": PROMPT, "max_tokens": 2}),
        ("GET", "/v1/models", None, None),
    ],
    "health": [("GET", "/health", None, None)],
    "collective_rpc": [
        ("POST", "/collective_rpc", None, {"method": "vime_set_weight_version", "kwargs": {"version": SECRET_VERSION}}),
        ("POST", "/collective_rpc", None, {"method": "vime_reload_weights", "kwargs": {"weights_path": "/tmp/x"}}),
    ],
    "sleep_wake_pause": [
        ("POST", "/sleep", {"level": "1"}, None),
        ("POST", "/wake_up", None, None),
        ("POST", "/pause", {"mode": "keep"}, None),
        ("POST", "/resume", None, None),
        ("GET", "/is_paused", None, None),
        ("POST", "/abort_requests", None, {}),
    ],
    "weight_update": [
        ("POST", "/start_weight_update", None, None),
        ("POST", "/update_weights", None, {"update_info": {}}),
        ("POST", "/finish_weight_update", None, {"weight_version": SECRET_VERSION}),
        ("POST", "/init_weight_transfer_engine", None, {"init_info": {}}),
        ("POST", "/update_weight_version", None, {"new_version": SECRET_VERSION}),
    ],
    "other": [
        ("GET", "/metrics", None, None),
        ("POST", "/reset_prefix_cache", None, None),
        ("GET", "/version", None, None),
        ("POST", "/invocations", None, {"prompt": PROMPT}),
        ("GET", "/ping", None, None),
        ("GET", "/openapi.json", None, None),
        ("GET", "/docs", None, None),
        ("GET", "/weight_info", None, None),
    ],
}
WRONG = {
    "no token": {},
    "wrong token": {"Authorization": "Bearer not-the-run-token"},
    "token as basic auth": None,
    "token in the query": None,
}  # the last two filled with the real token below


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def closed_engine(tiny_model_dir, vllm_python, cache_dir):
    """An engine of a run without the router: no route open. Its start's log lines are kept."""
    from vime_core.engines.server import EngineServer

    captured = Captured()
    logging.getLogger("vime_core.engines").addHandler(captured)
    logging.getLogger("vime_core.engines").setLevel(logging.DEBUG)
    server = EngineServer(
        make_cfg(tiny_model_dir, vllm_python, use_router=False),
        0,
        engines_per_node=1,
        log_dir=str(cache_dir / "engine-logs"),
    )
    try:
        server.start()
        yield server, captured
    finally:
        logging.getLogger("vime_core.engines").removeHandler(captured)
        server.shutdown()


def _wrong_headers(case: str, token: EngineToken) -> tuple[dict, dict]:
    """(headers, extra query) of an attacker's request."""
    if case == "token as basic auth":
        return {"Authorization": f"Basic {token.reveal()}"}, {}
    if case == "token in the query":
        return {}, {"token": token.reveal(), "api_key": token.reveal()}
    return WRONG[case], {}


def _attack(url: str, token: EngineToken, families=tuple(ATTACKS)) -> dict[str, int]:
    """Every request of `families` with every wrong credential: {request: status}."""
    answers = {}
    with httpx.Client(timeout=30) as http:
        for family in families:
            for i, (method, path, query, body) in enumerate(ATTACKS[family]):
                for case in WRONG:
                    headers, extra = _wrong_headers(case, token)
                    resp = http.request(
                        method, f"{url}{path}", params={**(query or {}), **extra}, json=body, headers=headers
                    )
                    answers[f"{case}: {family}[{i}] {method} {path}"] = resp.status_code
                    assert token.reveal() not in resp.text
    return answers


def _state(server) -> dict:
    """What an attack would change, read with the token."""
    client = server.client()
    return {
        "paused": client.is_paused(),
        "version": client.weight_version(),
        "worker_version": client.collective_rpc("vime_weight_version"),
        "sleeping": client.request("GET", "/is_sleeping")["is_sleeping"],
    }


def _requests_served(server) -> float:
    text = httpx.get(f"{server.url}/metrics", headers=auth_headers(server.auth_token), timeout=10).text
    return sum(float(m) for m in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def _works_with_the_token(server) -> None:
    """Each family with the token: generate, OpenAI, health, collective_rpc, pause/resume, a
    weight-update session opened (so none was left open by an attack) and closed."""
    client = server.client()
    answer = asyncio.run(_generate(server.url, server.auth_token))
    assert len(answer["choices"][0]["token_ids"]) == 2
    assert client.served_models() and client.health()
    version = client.weight_version()
    assert client.collective_rpc("vime_weight_version") != [SECRET_VERSION]
    client.pause("keep")
    assert client.is_paused()
    client.resume()
    client.init_weight_transfer({"shm_dir": "/dev/shm"})
    client.request("POST", "/start_weight_update")  # raises when a session is open (one an attack began)
    client.request("POST", "/finish_weight_update", json={})  # closed empty: no version set, old weights kept
    assert client.weight_version() == version and not client.is_paused()


async def _generate(url: str, token) -> dict:
    async with EngineClient(url, token=token) as client:
        return await client.generate(PROMPT, {"max_tokens": 2, "temperature": 0.0})


def test_every_route_of_an_engine_is_refused_without_the_token_and_nothing_happens(closed_engine):
    server, captured = closed_engine
    before = _state(server)
    answers = _attack(server.url, server.auth_token)
    assert set(answers.values()) == {401}, {k: v for k, v in answers.items() if v != 401}
    assert len(answers) == sum(map(len, ATTACKS.values())) * len(WRONG)
    assert _state(server) == before and before["paused"] is False and before["worker_version"] != [SECRET_VERSION]
    _works_with_the_token(server)
    secret = server.auth_token.reveal()
    assert captured.lines and not [line for line in captured.lines if secret in line]  # vime's own log lines
    assert secret not in server.log_path.read_text(errors="replace")  # vLLM's log, the launch line included
    assert not any(secret in word for word in server.command(server.port))


def test_a_router_run_opens_health_to_reads_and_nothing_else(healthy_engines):
    server = healthy_engines[0]
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200  # vllm-router's health checks
    assert httpx.post(f"{server.url}/health", timeout=10).status_code == 401
    families = [f for f in ATTACKS if f != "health"]
    before, served = _state(server), _requests_served(server)
    answers = _attack(server.url, server.auth_token, families)
    assert set(answers.values()) == {401}, {k: v for k, v in answers.items() if v != 401}
    assert _state(server) == before and _requests_served(server) == served  # no request reached the engine
    _works_with_the_token(server)
