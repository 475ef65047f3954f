"""The object store goes away during a whole `vime train` run, on real parts: SeaweedFS
S3 as the run's storage (batches, index, checkpoints, records), a Ray head, one vLLM CPU engine
behind vllm-router, one Megatron actor, Prefect. The endpoint reaches every process through the
configuration only: the driver's and the Ray workers' environments hold the credentials alone.

The S3 server is SIGKILLed as a persist task run starts (the driver pauses there:
vime_core/faults.PausePoints) and started again on the same ports and data folder:
- (a) back while persist still retries, with the default retries (persist_retry_delays_s,
  storage_request_retries): the restart begins when the console says persist's first try
  failed, so the outage is one the retries cover; the run goes on to its end without a failed
  iteration;
- (b) down for longer than every retry: the server comes back only after the driver ended. The
  run stops with one line saying what happened and what to do (exit 1), nothing of the batch is
  visible, and the same command, once the server is back, resumes the run to its end. Its
  configuration's retries are short ones (RETRIES_B), each tried and announced all the same.
Only persist meets the outage: the train task beside it needs no storage, and sync, the
checkpoint (save) and the report come after persist ends. The checkpoints are checked whole all
the same (a resumed run whose trainer died restores from the latest).

After each: every rollout id has exactly one published batch, read back (checksum) and trainable;
the optimizer made one step per rollout id; the bucket holds no object of an unpublished batch
(no upload, no batch object, no index manifest) and the index names exactly the batch objects.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.flows.test_faults import _check_run, _handles, _stderr_path, _tail, _wait_paused
from vime_core.storage.endpoint import ENDPOINT_ENV
from vime_core.storage.s3_server import start_s3_server, stop_s3_server

from .conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY
from .test_s3_outage import Outage

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

RUN = "s3-outage-run"
BUCKET = "vime-outage-run"
SHORT_OUTAGE_AT = 1  # persist-1: (a), its run's last iteration (its checkpoint and report follow)
RUN_A = SHORT_OUTAGE_AT + 1
LONG_OUTAGE_AT = RUN_A  # persist-2: (b), the iteration the extended run adds
RUN_B = LONG_OUTAGE_AT + 1
# (b)'s retries, short: persist waits these before its retries, each S3 request is retried once
RETRIES_B = dict(persist_retry_delays_s=[0.5, 1.0, 2.0], storage_request_retries=1)


@pytest.fixture(scope="module")
def s3_cluster(ray_head):
    """A SeaweedFS server of this module's own (it is killed) and the session's Ray head, whose
    workers hold its credentials but not its endpoint (the run's configuration carries it;
    tests/integration/conftest.py); this process holds both, for the checks. Yields (Outage,
    ray address)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", *ENDPOINT_ENV):
            mp.delenv(name, raising=False)
        mp.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
        data_dir = Path(tempfile.mkdtemp(prefix="vime-s3-run-"))
        try:
            server = start_s3_server(data_dir, bucket=BUCKET, timeout=60)
            mp.setenv("AWS_ENDPOINT_URL", server.endpoint)
            yield Outage(server), ray_head
        finally:
            stop_s3_server(data_dir)
            shutil.rmtree(data_dir, ignore_errors=True)


def _config(server, model, ray_address, num_rollout: int, **over):
    from tests.integration.small_run import small_run_config

    return small_run_config(
        run_name=RUN,
        storage_uri=server.storage_uri("runs"),
        hf_checkpoint=str(model),
        ray_address=ray_address,
        storage_endpoint_url=server.endpoint,
        num_rollout=num_rollout,
        save_interval=2,  # a checkpoint at the end of each run (rollouts 1 and 2)
        check_weight_update_equal=True,
        iteration_retries=0,  # only persist's own retries stand between the outage and the run
        **over,
    )


def _vime_train(
    cfg, tmp_path, name: str, pause_at=(), pause_dir=None, prefect_api: str = ""
) -> tuple[subprocess.Popen, Path]:
    """`vime train --config <the configuration>`, in its own session, with the S3 credentials and
    not the endpoint in its environment; `pause_at`: task runs it pauses at, announcing itself in
    `pause_dir`; `prefect_api`: the Prefect server it talks to, else a temporary one of its own."""
    from vime_core.config.loader import dump_config
    from vime_core.faults import PAUSE_AT_ENV, PAUSE_DIR_ENV

    config_file = Path(dump_config(cfg, tmp_path / f"run-{cfg.num_rollout}.json"))  # one per run: the same command
    unset = (PAUSE_AT_ENV, PAUSE_DIR_ENV, "PREFECT_API_URL", *ENDPOINT_ENV)
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    if pause_at:
        env.update({PAUSE_AT_ENV: ",".join(pause_at), PAUSE_DIR_ENV: str(pause_dir)})
    log = tmp_path / f"{name}.log"
    driver = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "train", "--config", str(config_file)],
        cwd=Path(__file__).resolve().parents[3],
        env=env,
        stdout=open(log, "w"),
        stderr=open(_stderr_path(log), "w"),
        start_new_session=True,
    )
    return driver, log


def _console(log: Path) -> str:
    return log.read_text() + _stderr_path(log).read_text()


def _persist_failures(log: Path, rollout_id: int) -> list[str]:
    """The console's notices of a retry of persist-<rollout_id> (tasks/common.RETRY_NOTICE: one
    warning per failed try that is tried again; Prefect's own notice is below the console's level
    under infra/env.sh, as in CI)."""
    return [
        line for line in _console(log).splitlines() if f"persist-{rollout_id} failed (" in line and "; try " in line
    ]


def _announced_delays(notices: list[str]) -> list[float]:
    """The wait each retry notice announces (`...; try N of M in D s`)."""
    return [float(re.search(r"; try \d+ of \d+ in (\S+) s$", line).group(1)) for line in notices]


def _wait_for(condition, driver, log, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert driver.poll() is None, f"the driver ended before {what}:\n{_tail(log)}"
        assert time.monotonic() < deadline, f"no {what}:\n{_tail(log)}"
        time.sleep(0.1)


def _check_bucket(cfg, num_published: int) -> None:
    """What the bucket holds for the run: batches 0 .. num_published-1 published, each whole; no
    object of any other batch (uploads, batch objects, manifests); the index names exactly the
    batch objects; every checkpoint folder is finished (its manifest and the files it lists)."""
    from vime_core.storage import BatchStore, layout
    from vime_core.trainer.checkpoint import MANIFEST, checkpoint_root

    store = BatchStore.for_config(cfg)
    refs = store.list_batches(RUN)
    assert [r.rollout_id for r in refs] == list(range(num_published))
    for ref in refs:
        store.read(RUN, ref.rollout_id)  # checksum against the object and the index
    keys = store.location.list_keys("")  # the raw bucket under the store's prefix
    assert [k for k in keys if k.startswith(f"{layout.TMP}/")] == []  # no upload left behind
    assert sorted(k for k in keys if k.startswith(f"{layout.BATCHES}/")) == sorted(r.key for r in refs)
    stems = {Path(r.key).name for r in refs}
    manifests = [k for k in keys if k.startswith(f"{layout.MANIFESTS}/")]
    assert all(k.startswith(f"{layout.MANIFESTS}/{RUN}/") and Path(k).name in stems for k in manifests), manifests

    root = store.location.path("")
    prefix = checkpoint_root(cfg).removeprefix(f"s3://{root}/") + "/"
    folders = {k[len(prefix) :].split("/", 1)[0] for k in keys if k.startswith(prefix)}
    assert folders, "no checkpoint"
    for folder in folders:
        manifest = json.loads(store.location.get(f"{prefix}{folder}/{MANIFEST}"))
        assert {k for k in keys if k.startswith(f"{prefix}{folder}/")} == {
            f"{prefix}{folder}/{n}" for n in [MANIFEST, *manifest["files"]]
        }


def _raw_records(cfg) -> list[dict]:
    """Every record metrics.jsonl holds, in the order written (read_records keeps the last per id)."""
    from vime_core.report.records import METRICS, report_location
    from vime_core.storage.endpoint import S3Endpoint

    text = report_location(cfg.storage_uri, cfg.run_name, S3Endpoint.of(cfg)).get(METRICS).decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _optimizer_steps(cfg) -> int:
    return _handles(cfg)[1].rank0("state")["optimizer_steps"]


def _store_down_at(driver, log: Path, outage, pause_file: Path) -> None:
    """Once the driver waits at the task run of `pause_file`, stop the S3 server and let it go on."""
    _wait_paused(driver, pause_file, log)
    outage.kill()
    pause_file.unlink()


def test_store_outages_during_a_train_run(s3_cluster, tiny_model_dir, tmp_path, new_prefect_home, session_prefect_api):
    from vime_core.cluster.run_actors import teardown

    outage, ray_address = s3_cluster
    server = outage.server
    pause_dir = tmp_path / "paused"
    pause_dir.mkdir()
    new_prefect_home(tmp_path / "prefect")  # every driver's (_vime_train)
    try:
        # (a) an outage persist's retries cover: the run goes on to its end
        cfg = _config(server, tiny_model_dir, ray_address, RUN_A)
        at = f"persist-{SHORT_OUTAGE_AT}"
        driver, log = _vime_train(cfg, tmp_path, "a", pause_at=[at], pause_dir=pause_dir)
        try:
            _store_down_at(driver, log, outage, pause_dir / at)
            _wait_for(lambda: _persist_failures(log, SHORT_OUTAGE_AT), driver, log, f"failed try of {at}")
            t0 = time.monotonic()
            outage.restart()
            back_after = time.monotonic() - t0
            rc = driver.wait(timeout=600)
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, 9)
        assert rc == 0, f"server back {back_after:.1f} s after the first failed try\n{_tail(log)}"
        notices = _persist_failures(log, SHORT_OUTAGE_AT)
        assert notices  # the outage was seen, and a later try stored it, after the default waits
        assert _announced_delays(notices) == cfg.persist_retry_delays_s[: len(notices)], notices
        stdout = log.read_text()
        summary = json.loads(stdout[stdout.index('{\n  "run_name"') :])
        assert summary["failed_attempts"] == {}  # no iteration failed: persist's retries absorbed it
        _check_run(cfg, RUN_A)
        _check_bucket(cfg, RUN_A)
        assert _optimizer_steps(cfg) == RUN_A * cfg.num_steps_per_rollout

        # (b) an outage longer than every retry: the run stops cleanly; the same command resumes it
        cfg = _config(server, tiny_model_dir, ray_address, RUN_B, **RETRIES_B)
        at = f"persist-{LONG_OUTAGE_AT}"
        driver, log = _vime_train(cfg, tmp_path, "b", pause_at=[at], pause_dir=pause_dir)
        try:
            _store_down_at(driver, log, outage, pause_dir / at)
            rc = driver.wait(timeout=600)  # the server stays down until the driver has ended
        finally:
            if driver.poll() is None:
                os.killpg(driver.pid, 9)
        outage.restart()
        assert rc == 1, _tail(log)
        # each retry's notice, with the configuration's wait; the last try's failure is said by
        # the run's own line below
        notices = _persist_failures(log, LONG_OUTAGE_AT)
        assert _announced_delays(notices) == cfg.persist_retry_delays_s, notices
        stderr = _stderr_path(log).read_text()
        said = [line for line in stderr.splitlines() if line.startswith("[vime] run")]
        assert len(said) == 1, said  # the user's last word from vime, once
        assert said[0].startswith(f"[vime] run {RUN!r} stopped: iteration {LONG_OUTAGE_AT} failed: "), said
        assert "(EndpointConnectionError)" in said[0] and "run the same command again to resume" in said[0], said
        assert "Traceback" not in stderr and '\n  File "' not in stderr, stderr[-5000:]
        _check_bucket(cfg, LONG_OUTAGE_AT)  # nothing of the failed batch is visible

        # the stopped drivers' own temporary server ended with each (its last words checked
        # above); the resumed one talks to the session's (tests/integration/conftest.py)
        driver, log = _vime_train(cfg, tmp_path, "b-resumed", prefect_api=session_prefect_api)
        assert driver.wait(timeout=600) == 0, _tail(log)
        _check_run(cfg, RUN_B, resumed=frozenset({LONG_OUTAGE_AT}))
        _check_bucket(cfg, RUN_B)
        assert _optimizer_steps(cfg) == RUN_B * cfg.num_steps_per_rollout
        # the failed iteration ended before its report: every rollout id reported once
        assert [r["rollout_id"] for r in _raw_records(cfg)] == list(range(RUN_B))
    finally:
        _handles(_config(server, tiny_model_dir, ray_address, RUN_B, **RETRIES_B))  # attached, whatever failed
        teardown(RUN)
