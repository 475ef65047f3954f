"""The storage retries a run's configuration sets (persist_retry_delays_s, storage_request_retries)
reach what retries: the persist task Prefect runs, and the botocore client of an s3:// store."""

from __future__ import annotations

import pytest

from tasks.rollout import persist, persist_for
from vime_core.config import load_config
from vime_core.storage.endpoint import S3Endpoint
from vime_core.storage.fs import open_location

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("delays", [[0.5, 1.0, 2.0], [3.0], []])
def test_persist_retries_once_per_configured_delay_waiting_that_long(delays):
    cfg = load_config(overrides={"persist_retry_delays_s": delays})
    task = persist_for(cfg)
    assert (task.retries, list(task.retry_delay_seconds or [])) == (len(delays), delays)
    # the rest of the task is persist's: its name, run names, retry condition and hooks
    assert (task.name, task.task_run_name, task.retry_condition_fn) == (
        persist.name,
        persist.task_run_name,
        persist.retry_condition_fn,
    )
    assert task.on_running_hooks == persist.on_running_hooks


def test_the_default_configuration_keeps_persists_own_retries():
    cfg = load_config(overrides={})
    task = persist_for(cfg)
    assert (task.retries, task.retry_delay_seconds) == (persist.retries, persist.retry_delay_seconds)
    assert persist.retries == len(cfg.persist_retry_delays_s) > 0


def test_a_negative_delay_is_refused_naming_the_field():
    with pytest.raises(Exception, match="persist_retry_delays_s"):
        load_config(overrides={"persist_retry_delays_s": [1.0, -2.0]})


@pytest.mark.parametrize("retries", [0, 1, None])
def test_request_retries_reach_the_botocore_client(retries, monkeypatch):
    """botocore counts tries: retries + 1; unset, botocore's own count stays (nothing is passed)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    cfg = load_config(
        overrides={
            "storage_uri": "s3://bucket/p",
            "storage_endpoint_url": "http://127.0.0.1:9",
            "storage_request_retries": retries,
        }
    )
    assert S3Endpoint.of(cfg).request_retries == retries
    fs = open_location(cfg.storage_uri, endpoint=S3Endpoint.of(cfg)).fs
    fs.connect()  # the client is made here, without a request
    tries = fs.s3.meta.config.retries.get("total_max_attempts")
    assert tries == (None if retries is None else retries + 1)
