"""Where an s3:// store's server is: the configuration's value, else the environment, resolved
in one place (vime_core/storage/endpoint.py) and never carrying credentials."""

from __future__ import annotations

import pytest

from vime_core.config import load_config
from vime_core.storage.endpoint import ENDPOINT_ENV, REGION_ENV, EndpointCredentialsError, S3Endpoint, resolve
from vime_core.storage.fs import open_location


def test_a_value_wins_then_the_variables_in_order():
    specific, generic = "http://127.0.0.1:1", "http://127.0.0.1:2"
    env = {ENDPOINT_ENV[0]: specific, ENDPOINT_ENV[1]: generic, REGION_ENV[0]: "r-a", REGION_ENV[1]: "r-b"}
    assert resolve(environ=env) == S3Endpoint(specific, "r-a")
    assert resolve(environ={ENDPOINT_ENV[1]: generic, REGION_ENV[1]: "r-b"}) == S3Endpoint(generic, "r-b")
    assert resolve("http://given:3", "r-given", environ=env) == S3Endpoint("http://given:3", "r-given")
    assert resolve(environ={}) == S3Endpoint()


def test_the_configuration_reads_the_environment_once_when_it_is_made(monkeypatch):
    for name in ENDPOINT_ENV + REGION_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENDPOINT_ENV[1], "http://127.0.0.1:4")
    monkeypatch.setenv(REGION_ENV[1], "r-env")
    cfg = load_config(overrides={"storage_uri": "s3://bucket/p"})
    monkeypatch.setenv(ENDPOINT_ENV[1], "http://127.0.0.1:5")  # later changes reach no made configuration
    assert S3Endpoint.of(cfg) == S3Endpoint("http://127.0.0.1:4", "r-env")
    explicit = load_config(overrides={"storage_uri": "s3://bucket/p", "storage_endpoint_url": "http://127.0.0.1:6"})
    assert explicit.storage_endpoint_url == "http://127.0.0.1:6"
    location = open_location(cfg.storage_uri, endpoint=S3Endpoint.of(cfg))
    assert location.endpoint == cfg.storage_endpoint_url
    assert location.fs.client_kwargs["region_name"] == cfg.storage_region
    assert open_location(cfg.storage_uri).endpoint == "http://127.0.0.1:5"  # no endpoint given: this process's


@pytest.mark.parametrize("where", ["field", "variable"])
def test_an_endpoint_carrying_credentials_is_refused_without_repeating_them(where, monkeypatch):
    secret = "sk-endpoint-secret"
    url = f"http://key:{secret}@127.0.0.1:7"
    for name in ENDPOINT_ENV:
        monkeypatch.delenv(name, raising=False)
    overrides = {"storage_uri": "s3://bucket/p"}
    if where == "field":
        overrides["storage_endpoint_url"] = url
    else:
        monkeypatch.setenv(ENDPOINT_ENV[1], url)
    with pytest.raises(EndpointCredentialsError) as info:
        load_config(overrides=overrides)
    assert ("storage_endpoint_url" if where == "field" else ENDPOINT_ENV[1]) in str(info.value)
    assert secret not in str(info.value) and secret not in repr(info.value)
