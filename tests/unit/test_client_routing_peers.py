"""Routed experts behind vllm-router: the router's client arms every engine behind it and takes each
request's rows from whichever engine holds them (the router does not say which engine answered).
The engines' HTTP answers are stubbed here; tests/integration/rollout/test_routing_capture.py runs
the real router in front of a real engine."""

from __future__ import annotations

import asyncio

import pytest

from vime_core.engines.client import (
    ARM_CAPTURE_RPC,
    ROUTED_EXPERTS_START,
    TAKE_ROUTED_EXPERTS_RPC,
    EngineClient,
    EngineError,
)

pytestmark = pytest.mark.unit

LAYOUT = {"layers": 2, "top_k": 2, "dtype": "uint8"}


class FakeEngine(EngineClient):
    """An engine client whose /collective_rpc is answered here: it holds the rows of `held` requests."""

    def __init__(self, name: str, held: dict[str, str], fails: bool = False) -> None:
        super().__init__(f"http://127.0.0.1:1/{name}", name)
        self.held, self.fails = dict(held), fails
        self.calls: list[tuple[str, dict]] = []

    async def collective_rpc(self, method, kwargs=None, args=None, timeout_s=None):
        self.calls.append((method, kwargs or {}))
        if self.fails:
            raise EngineError(self.name, f"POST /collective_rpc {method}", None, "connection refused")
        if method == ARM_CAPTURE_RPC:
            return [LAYOUT, LAYOUT]  # two TP ranks
        assert method == TAKE_ROUTED_EXPERTS_RPC
        return [{rid: self.held.pop(rid, None) for rid in kwargs["request_ids"]}]

    def count(self, method: str) -> int:
        return sum(1 for m, _ in self.calls if m == method)


class FakeRouter(EngineClient):
    """vllm-router's client: every generate answers one token, whichever engine generated it."""

    async def request(self, method, path, *, params=None, json=None, headers=None, timeout_s=None):
        return {"choices": [{"token_ids": [7], "routed_experts": None}]}


def _generate(router: EngineClient, request_ids: list[str]) -> list:
    async def all_of_them():
        calls = [router.generate([1, 2, 3], {ROUTED_EXPERTS_START: 0}, request_id=r) for r in request_ids]
        return await asyncio.gather(*calls, return_exceptions=True)

    return asyncio.run(all_of_them())


def test_rows_come_from_the_engine_that_holds_them_in_one_take_each():
    engines = [FakeEngine("engine-0", {"a": "rows-a"}), FakeEngine("engine-1", {"b": "rows-b", "c": "rows-c"})]
    router = FakeRouter("http://127.0.0.1:2", "router", capture_peers=engines)
    answers = _generate(router, ["a", "b", "c"])
    assert [answer["choices"][0]["routed_experts"] for answer in answers] == ["rows-a", "rows-b", "rows-c"]
    for engine in engines:  # armed once, asked once for the three answers that came together
        assert engine.count(ARM_CAPTURE_RPC) == 1 and engine.count(TAKE_ROUTED_EXPERTS_RPC) == 1
        assert engine.held == {}
    assert asyncio.run(router.arm_routing_capture()) is None  # armed engines are not armed again
    assert [engine.count(ARM_CAPTURE_RPC) for engine in engines] == [1, 1]


def test_an_engine_that_fails_fails_only_the_requests_no_other_engine_holds():
    engines = [FakeEngine("engine-0", {"a": "rows-a"}), FakeEngine("engine-1", {}, fails=False)]
    router = FakeRouter("http://127.0.0.1:2", "router", capture_peers=engines)
    assert asyncio.run(router.arm_routing_capture()) == LAYOUT  # both armed while engine-1 answers
    engines[1].fails = True
    found, lost = _generate(router, ["a", "b"])
    assert found["choices"][0]["routed_experts"] == "rows-a"
    assert isinstance(lost, EngineError) and "engine-1" in str(lost) and "connection refused" in str(lost)


def test_rows_nobody_holds_name_the_request_and_rearm_every_engine():
    engines = [FakeEngine("engine-0", {}), FakeEngine("engine-1", {})]
    router = FakeRouter("http://127.0.0.1:2", "router", capture_peers=engines)
    (missing,) = _generate(router, ["lost"])
    assert isinstance(missing, EngineError) and "no routed experts captured for request lost" in str(missing)
    engines[1].held["next"] = "rows-next"  # a restarted engine's workers are armed again first
    (answer,) = _generate(router, ["next"])
    assert answer["choices"][0]["routed_experts"] == "rows-next"
    assert [engine.count(ARM_CAPTURE_RPC) for engine in engines] == [2, 2]


def test_a_restarted_engines_new_client_is_asked():
    engines = [FakeEngine("engine-0", {})]
    router = FakeRouter("http://127.0.0.1:2", "router", capture_peers=engines)
    asyncio.run(router.arm_routing_capture())
    engines[0] = FakeEngine("engine-0", {"z": "rows-z"})  # the fleet swaps the client in place (fleet._url_changed)
    (answer,) = _generate(router, ["z"])
    assert answer["choices"][0]["routed_experts"] == "rows-z" and engines[0].count(ARM_CAPTURE_RPC) == 1
