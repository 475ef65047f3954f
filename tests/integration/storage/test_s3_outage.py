"""The object store goes away while batches are persisted, on a real S3 server.

The SeaweedFS process is SIGKILLed and started again a few seconds later on the same ports and
data folder (what a restarted or briefly unreachable S3 endpoint looks like to a client):
- cut at each step of a write (before the upload, before the move to the final key, before the
  manifest: the publish point), the write fails with an error the train flow retries
  (infrastructure), nothing of it is visible, and the retried write publishes it;
- the persist task (Prefect task, the write in a Ray task beside the data) started while the
  server is down retries with a back-off and stores the batch once the server is back.
After each: every rollout id has exactly one readable, trainable batch; every object under
`batches/` in the raw bucket is whole (checksum verified); leftovers are unpublished uploads
only, which remove_orphans deletes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from vime_core.storage.s3_server import STATE_FILE, S3Server, serving, start_s3_server, stop_s3_server

from .conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = "s3-outage"
BUCKET = "vime-outage"


class Outage:
    """Kill the S3 server and start it again with the same command line (ports, data folder)."""

    def __init__(self, server: S3Server):
        self.server = server
        self.args = [a.decode() for a in Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0") if a]
        self.kills = 0

    def kill(self) -> None:
        os.kill(self.server.pid, signal.SIGKILL)
        try:
            os.waitpid(self.server.pid, 0)
        except ChildProcessError:
            pass
        self.kills += 1

    def restart(self, timeout: float = 60.0, attempts: int = 5) -> None:
        """Start the same command again until it serves. A start that exits at once is tried again
        after a pause (CI34: the restarted server exited 1; one of its fixed ports can be held for
        a while by a client connection's local port, which the OS picks from the same range)."""
        data_dir = Path(self.server.data_dir)
        deadline = time.monotonic() + timeout
        for attempt in range(1, attempts + 1):
            with open(data_dir / "weed.log", "ab") as log:
                process = subprocess.Popen(
                    self.args,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=data_dir,
                    start_new_session=True,
                )
            self.server.pid = process.pid
            (data_dir / STATE_FILE).write_text(json.dumps(self.server.__dict__))  # stop_s3_server ends this one
            while process.poll() is None and not serving(self.server.endpoint, self.server.bucket):
                assert time.monotonic() < deadline, f"S3 server did not come back in {timeout:.0f} s"
                time.sleep(0.3)
            if process.poll() is None:
                return  # back: what it held reads again
            tail = (data_dir / "weed.log").read_text(errors="replace").splitlines()[-5:]
            assert attempt < attempts and time.monotonic() < deadline, (
                f"S3 server exited {process.returncode} on each of {attempt} starts; weed.log ends: {tail}"
            )
            time.sleep(2.0)

    def restart_after(self, seconds: float) -> threading.Thread:
        thread = threading.Thread(target=lambda: (time.sleep(seconds), self.restart()), daemon=True)
        thread.start()
        return thread


@pytest.fixture(scope="module")
def outage_server() -> S3Server:
    """A server of this module's own (the session's server must stay up), started once: each test
    kills and restarts it and writes under a prefix of its own."""
    data_dir = Path(tempfile.mkdtemp(prefix="vime-s3-outage-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
        mp.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
        server = start_s3_server(data_dir, bucket=BUCKET, timeout=60)
    try:
        yield server
    finally:
        stop_s3_server(data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


@pytest.fixture
def outage(outage_server, monkeypatch):
    """The module's server, not yet killed in this test, with the client's env; up again after the
    test (one that failed may have left it down)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_SECRET_KEY)
    monkeypatch.setenv("AWS_ENDPOINT_URL", outage_server.endpoint)
    outage = Outage(outage_server)
    yield outage
    if not serving(outage_server.endpoint, outage_server.bucket):
        outage.restart()


def _check_store(uri: str, rollout_ids: list[int]) -> list[str]:
    """Invariants of the store after an outage (module docstring); returns the leftover keys."""
    from vime_core.data.validation import validate_trainable
    from vime_core.storage import BatchStore
    from vime_core.storage.retention import remove_orphans
    from vime_core.storage.store import verify_table

    store = BatchStore(uri)
    refs = store.list_batches(RUN)
    assert [r.rollout_id for r in refs] == rollout_ids  # one published batch per rollout id
    for ref in refs:
        batch, _ = store.read(RUN, ref.rollout_id)  # checksum against the object and the index
        assert validate_trainable(batch) == 16
    published = {r.key for r in refs}
    raw = store.location.list_keys("")  # the raw bucket under the store's prefix
    for key in raw:
        if key.startswith("batches/"):
            verify_table(store.location.get(key), key)  # whole, even when unpublished
    leftovers = sorted(k for k in raw if k.startswith(("batches/", "tmp/")) and k not in published)
    assert all(k.startswith(f"tmp/{RUN}/") or k.startswith(f"batches/{RUN}/") for k in leftovers), leftovers
    assert sorted(remove_orphans(store, older_than="0s", dry_run=False)) == leftovers
    assert {k for k in store.location.list_keys("") if k.startswith(("batches/", "tmp/"))} == published
    return leftovers


@pytest.mark.parametrize("cut", ["upload", "move", "manifest"])
def test_a_write_cut_by_the_store_going_away_leaves_nothing_visible(outage, monkeypatch, cut):
    """The server dies just before one step of BatchStore.write: the write fails with an error
    the train flow retries, rollout 1 is not visible, and once the server is back the retried
    write publishes it; nothing half-written is ever listed."""
    from vime_core.faults import INFRASTRUCTURE, classify
    from vime_core.storage import BatchStore
    from vime_core.storage.endpoint import S3Endpoint
    from vime_core.storage.fs import StorageLocation
    from vime_core.storage.index import BatchIndex
    from vime_core.storage.synthetic import synthetic_batch

    uri = outage.server.storage_uri(f"t-{uuid.uuid4().hex[:8]}")
    BatchStore(uri).write(synthetic_batch(seed=0), {"run": RUN, "rollout_id": 0})
    owner, name = {
        "upload": (StorageLocation, "put"),
        "move": (StorageLocation, "move"),
        "manifest": (BatchIndex, "publish"),
    }[cut]
    real = getattr(owner, name)

    def killed_first(self, *args, **kwargs):
        if not outage.kills:
            outage.kill()
        return real(self, *args, **kwargs)

    monkeypatch.setattr(owner, name, killed_first)
    batch = synthetic_batch(seed=1)
    # each request tried twice (storage_request_retries=1), not botocore's five times: the cut
    # step and the cleanup after it fail within a second, by the same error
    cut_short = S3Endpoint(outage.server.endpoint, request_retries=1)
    with pytest.raises(Exception) as info:
        BatchStore(uri, endpoint=cut_short).write(batch, {"run": RUN, "rollout_id": 1})
    fault = classify(info.value)
    assert (fault.kind, fault.retryable) == (INFRASTRUCTURE, True), repr(info.value)
    monkeypatch.setattr(owner, name, real)
    outage.restart()

    store = BatchStore(uri)
    assert not store.exists(RUN, 1) and [r.rollout_id for r in store.list_batches(RUN)] == [0]
    store.write(batch, {"run": RUN, "rollout_id": 1})  # the retry
    assert store.read(RUN, 1)[0] == batch
    leftovers = _check_store(uri, [0, 1])
    # the upload that was cut before it began left nothing; later cuts leave their upload or
    # the unpublished object behind (the cleanup could not reach the store either)
    assert (cut == "upload") == (leftovers == [])


def test_persist_retries_with_a_back_off_until_the_store_is_back(outage, ray_head, tiny_model_dir):
    """persist-1 starts while the server is down; it comes back after 6 s: the task's default
    retries (persist_retry_delays_s, each try after botocore's own) store the batch, once. The
    write runs in a Ray task on the session's head, whose workers hold the credentials; the
    endpoint comes with the configuration, as in a run."""
    import ray

    from tasks.rollout import RolloutOutput, persist_for
    from vime_core.cluster.connect import ensure_ray
    from vime_core.demo.settings import demo_config
    from vime_core.storage import BatchStore
    from vime_core.storage.synthetic import synthetic_batch

    uri = outage.server.storage_uri(f"t-{uuid.uuid4().hex[:8]}")
    cfg = demo_config(
        run_name=RUN,
        storage_uri=uri,
        storage_endpoint_url=outage.server.endpoint,
        hf_checkpoint=str(tiny_model_dir),
        ray_address=ray_head,
    )
    ensure_ray(ray_head)
    persist = persist_for(cfg)  # the flow's: the configuration's retries
    first = persist(cfg, 0, RolloutOutput(ray.put(synthetic_batch(seed=0))), "flow-0")
    assert first["key"] == BatchStore(uri).ref(RUN, 0).key

    batch = synthetic_batch(seed=1)
    outage.kill()
    back = outage.restart_after(6.0)
    t0 = time.monotonic()
    info = persist(cfg, 1, RolloutOutput(ray.put(batch)), "flow-1")
    waited = time.monotonic() - t0
    back.join()
    assert waited > 6.0  # it failed while the server was down and was tried again
    store = BatchStore(uri)
    assert info["key"] == store.ref(RUN, 1).key
    batch_read, lineage = store.read(RUN, 1)
    assert batch_read == batch and lineage["flow_run_id"] == "flow-1"
    _check_store(uri, [0, 1])


def test_a_restarted_server_is_back_once_what_it_held_reads_again(outage):
    """Started again on its data folder, the server lists the bucket seconds before its volume
    server reports the volumes that hold the bytes (a read in between: InternalError, HTTP 500).
    Outage.restart returns once every object reads back, so a check right after it, with no
    retry, meets the bytes (CI once failed there reading the run's index)."""
    import s3fs

    server = outage.server
    prefix = f"{server.bucket}/held-{uuid.uuid4().hex[:8]}"
    client = s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True)
    blobs = {f"{prefix}/r{i % 4}/{i}.bin": os.urandom(2_000_000 + i) for i in range(48)}
    client.pipe(blobs)  # ~96 MB: more than one 64-MB volume (-master.volumeSizeLimitMB)
    for _ in range(2):
        outage.kill()
        outage.restart()
        fresh = s3fs.S3FileSystem(
            endpoint_url=server.endpoint,
            skip_instance_cache=True,
            use_listings_cache=False,
            config_kwargs={"retries": {"max_attempts": 1}},
        )
        assert {path: fresh.cat_file(path) for path in blobs} == blobs
    client.rm(prefix, recursive=True)
