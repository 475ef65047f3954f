"""Nothing vime starts listens beyond loopback unauthenticated: engine_auth=false with an
engine_bind_host beyond loopback is refused at configuration time in one line, unless
allow_unauthenticated_engines, and then a warning names what is open."""

from __future__ import annotations

import logging

import pytest


def _cfg(**values):
    from vime_core.config import make_config
    from vime_core.demo.settings import demo_values

    return make_config(demo_values({"device": "cpu", **values}))


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "node-7.cluster", ""])
def test_a_bind_beyond_loopback_without_auth_is_refused_in_one_line(host):
    from vime_core.config.loader import ConfigError

    with pytest.raises(ConfigError) as err:
        _cfg(engine_bind_host=host, engine_auth=False)
    cause = str(err.value).splitlines()[-1].strip()
    assert cause.startswith(f"engine_bind_host={host!r} is beyond loopback and engine_auth=false")
    assert "--allow-unauthenticated-engines" in cause


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_loopback_without_auth_is_allowed_silently(host, caplog):
    with caplog.at_level(logging.WARNING):
        assert _cfg(engine_bind_host=host, engine_auth=False).engine_auth is False
    assert not caplog.records


def test_allowing_it_warns_what_is_exposed(caplog):
    with caplog.at_level(logging.WARNING, logger="vime_core.config.derive"):
        _cfg(engine_bind_host="0.0.0.0", engine_auth=False, allow_unauthenticated_engines=True)
    [record] = [r for r in caplog.records if "allow_unauthenticated_engines" in r.getMessage()]
    for exposed in (
        "generate",
        "/collective_rpc",
        "/pause",
        "weight-update session",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
    ):
        assert exposed in record.getMessage()


def test_auth_on_beyond_loopback_and_external_servers_are_not_refused():
    assert _cfg(engine_bind_host="0.0.0.0").engine_auth is True
    assert _cfg(engine_bind_host="0.0.0.0", engine_auth=False, engine_urls=["http://h:1"]).engine_urls
