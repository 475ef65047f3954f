"""The real vllm-router in front of two real engines of a run. vllm-router 0.1.17 cannot
ask for a key on inbound requests and sends none to its workers (`--api-key` does
neither), so vime binds it to 127.0.0.1, where only the RolloutManager on its node calls it, and
gives it no token: it forwards the caller's `Authorization` header, and the engines check it. Every
route family through the router without the token is refused (the engines' 401) and changes
nothing; the run's own requests go through; the router's ports do not answer on this machine's
other addresses."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.integration.rollout.test_engine_auth import _attack, _generate, _requests_served, _state

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_router_forwards_only_the_callers_token_and_listens_on_loopback(healthy_engines, cache_dir):
    import psutil

    from vime_core.engines.router import Router

    urls, token = [s.url for s in healthy_engines], healthy_engines[0].auth_token
    router = Router("round_robin", worker_urls=urls, log_dir=str(cache_dir / "engine-logs"))
    command = " ".join(router.command())
    assert "--host 127.0.0.1 " in command and "--prometheus-host 127.0.0.1 " in command
    router.start()
    try:
        before = [_state(s) for s in healthy_engines], [_requests_served(s) for s in healthy_engines]
        answers = _attack(
            router.url, token, ["generate", "openai", "collective_rpc", "sleep_wake_pause", "weight_update"]
        )
        assert set(answers.values()) == {401}, {k: v for k, v in answers.items() if v != 401}
        assert ([_state(s) for s in healthy_engines], [_requests_served(s) for s in healthy_engines]) == before
        answer = asyncio.run(_generate(router.url, token))  # the run's own requests go through
        assert len(answer["choices"][0]["token_ids"]) == 2
        assert token.reveal() not in router.log_path.read_text(errors="replace")
        # bound to 127.0.0.1: this machine's other addresses do not answer on the router's ports
        others = [
            a.address
            for addrs in psutil.net_if_addrs().values()
            for a in addrs
            if a.family == socket.AF_INET and not a.address.startswith("127.")
        ]
        for address in others:
            for port in (router.port, router.prometheus_port):
                with pytest.raises(OSError):
                    socket.create_connection((address, port), timeout=2).close()
        print(f"router ports {router.port}, {router.prometheus_port}: closed on {others or 'no non-loopback address'}")
    finally:
        router.shutdown()
