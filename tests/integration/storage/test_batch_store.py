"""BatchStore against a local folder and a real S3 server (SeaweedFS): round trip, concurrency,
killed writers, corruption, schema versions, credentials."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime_core.storage import (
    SCHEMA_VERSION,
    BatchExistsError,
    BatchNotFoundError,
    BatchStore,
    CorruptBatchError,
    SchemaVersionError,
)
from vime_core.storage import layout
from vime_core.storage.index import index_row
from vime_core.storage.schema import COLUMNS, BATCH_SCHEMA, UPGRADES, batch_to_table, table_checksum
from vime_core.storage.synthetic import synthetic_batch

from .conftest import TEST_ACCESS_KEY, TEST_SECRET_KEY

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.timeout(120)


def lineage(run: str, rollout_id: int, **extra) -> dict:
    return {"run": run, "rollout_id": rollout_id, "config_hash": "h", "config": {"seed": 1}, **extra}


def test_round_trip_is_exact(store_uri):
    store = BatchStore(store_uri)
    batch = synthetic_batch(num_groups=4, group_size=8, max_response_len=64, seed=11)
    assert not store.exists("run-a", 7)
    ref = store.write(batch, lineage("run-a", 7, flow_run_id="flow-42", model_id="tiny"))
    assert store.exists("run-a", 7)
    back, meta = store.read("run-a", 7)
    assert back == batch
    assert meta["flow_run_id"] == "flow-42" and meta["model_id"] == "tiny" and meta["checksum"] == ref.checksum
    assert ref.uri.endswith(ref.key) and ref.num_rows == len(batch["prompt_id"])
    assert [r.rollout_id for r in store.list("run-a")] == [7]
    with pytest.raises(BatchExistsError, match="run-a/7"):
        store.write(batch, lineage("run-a", 7))


def test_overwrite_replaces_and_removes_the_old_object(store_uri):
    store = BatchStore(store_uri)
    first = store.write(synthetic_batch(seed=1), lineage("r", 0))
    second_batch = synthetic_batch(seed=2)
    second = store.write(second_batch, lineage("r", 0), overwrite=True)
    assert store.read("r", 0)[0] == second_batch
    keys = store.location.list_keys("")
    assert first.key not in keys and second.key in keys
    assert store.index().num_rows == 1


def test_missing_batch_is_reported(store_uri):
    with pytest.raises(BatchNotFoundError, match="nobody/3"):
        BatchStore(store_uri).read("nobody", 3)


def test_concurrent_thread_writers_of_different_batches(store_uri):
    store = BatchStore(store_uri)
    batches = {i: synthetic_batch(seed=100 + i, weight_version=i) for i in range(8)}
    with ThreadPoolExecutor(max_workers=8) as pool:
        refs = list(pool.map(lambda i: store.write(batches[i], lineage("threads", i)), batches))
    assert sorted(r.rollout_id for r in refs) == list(batches)
    assert store.index().column("rollout_id").to_pylist() == list(batches)
    for i, batch in batches.items():
        assert store.read("threads", i)[0] == batch


WRITER = textwrap.dedent(
    """
    import sys, time
    from vime_core.storage import BatchStore
    from vime_core.storage.synthetic import synthetic_batch
    uri, run, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = BatchStore(uri)
    for i in range(first, first + count):
        store.write(synthetic_batch(seed=i), {"run": run, "rollout_id": i})
    """
)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_concurrent_process_writers_with_a_compaction_in_between(store_uri):
    procs = [
        subprocess.Popen([sys.executable, "-c", WRITER, store_uri, "procs", str(first), "4"], env=_env())
        for first in (0, 4)
    ]
    store = BatchStore(store_uri)
    compacted_while_writing = 0
    while any(p.poll() is None for p in procs):
        compacted_while_writing = store.compact()
        time.sleep(0.05)
    assert [p.returncode for p in procs] == [0, 0]
    assert store.index().column("rollout_id").to_pylist() == list(range(8))
    store.compact()
    assert store.index().column("rollout_id").to_pylist() == list(range(8))
    for i in range(8):
        assert store.read("procs", i)[0] == synthetic_batch(seed=i)
    assert compacted_while_writing <= 8


def test_concurrent_compactions_beside_writers_lose_nothing(store_uri):
    """Two compactors loop while four writers publish: every batch stays listed throughout."""
    store = BatchStore(store_uri)
    done = threading.Event()
    seen_counts: list[int] = []

    def compactor():
        while not done.is_set():
            store.compact()

    def reader():
        while not done.is_set():
            seen_counts.append(store.index().num_rows)

    workers = [threading.Thread(target=compactor) for _ in range(2)] + [threading.Thread(target=reader)]
    for w in workers:
        w.start()
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda i: store.write(synthetic_batch(seed=i), lineage("race", i)), range(12)))
    finally:
        done.set()
        for w in workers:
            w.join()
    assert store.index().column("rollout_id").to_pylist() == list(range(12))
    store.compact()
    assert store.index().column("rollout_id").to_pylist() == list(range(12))
    assert len(store.location.list_keys(layout.COMPACTED)) == 1 and store.location.list_keys(layout.MANIFESTS) == []
    # The index never shrank while batches were only being added.
    assert all(b >= a for a, b in zip(seen_counts, seen_counts[1:])), seen_counts


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from vime_core.storage import BatchStore
    from vime_core.storage.index import BatchIndex
    from vime_core.storage.store import BatchStore as Store
    from vime_core.storage.synthetic import synthetic_batch
    uri, stage, marker = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    def hang(*args, **kwargs):
        marker.write_text("ready")  # the parent kills us now
        time.sleep(600)

    if stage == "before_move":
        Store._publish = hang          # upload verified, not moved, not indexed
    else:
        BatchIndex.publish = hang      # moved to its final key, manifest not written
    BatchStore(uri).write(synthetic_batch(seed=5), {"run": "killed", "rollout_id": 5})
    """
)


@pytest.mark.parametrize("stage", ["before_move", "before_manifest"])
def test_writer_killed_before_publishing_leaves_no_visible_batch(store_uri, stage, tmp_path):
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, store_uri, stage, str(marker)], env=_env())
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None, "writer exited before reaching the publish step"
            assert time.monotonic() < deadline, "writer did not reach the publish step"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = BatchStore(store_uri)
    leftovers = store.location.list_keys("")
    assert leftovers, "the killed writer should have left its upload behind"
    assert any(k.startswith(layout.TMP if stage == "before_move" else layout.BATCHES) for k in leftovers)
    assert not store.exists("killed", 5)
    assert store.index().num_rows == 0
    with pytest.raises(BatchNotFoundError):
        store.read("killed", 5)
    # A retried write succeeds and is the one readers see.
    store.write(synthetic_batch(seed=6), {"run": "killed", "rollout_id": 5})
    assert store.read("killed", 5)[0] == synthetic_batch(seed=6)


def _rewrite(store: BatchStore, key: str, table: pa.Table) -> None:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    store.location.put(key, sink.getvalue())


def test_changed_value_is_detected(store_uri):
    store = BatchStore(store_uri)
    ref = store.write(synthetic_batch(seed=3), lineage("corrupt", 1))
    table = pq.read_table(io.BytesIO(store.location.get(ref.key)))
    rewards = table.column("raw_reward").to_pylist()
    rewards[0] = 1.0 - rewards[0]
    column = COLUMNS.index("raw_reward")
    _rewrite(
        store, ref.key, table.set_column(column, BATCH_SCHEMA.field("raw_reward"), pa.array(rewards, pa.float64()))
    )
    with pytest.raises(CorruptBatchError, match=ref.key) as info:
        store.read("corrupt", 1)
    assert info.value.key == ref.key


def test_flipped_bytes_are_detected(store_uri):
    store = BatchStore(store_uri)
    ref = store.write(synthetic_batch(seed=4), lineage("corrupt", 2))
    data = bytearray(store.location.get(ref.key))
    middle = len(data) // 2
    data[middle : middle + 16] = bytes(b ^ 0xFF for b in data[middle : middle + 16])
    store.location.put(ref.key, bytes(data))
    with pytest.raises(CorruptBatchError, match=ref.key):
        store.read("corrupt", 2)


def test_recomputed_checksum_still_disagrees_with_the_index(store_uri):
    """Someone rewrote the object with a self-consistent checksum: the index catches it."""
    store = BatchStore(store_uri)
    ref = store.write(synthetic_batch(seed=5), lineage("corrupt", 3))
    other = batch_to_table(synthetic_batch(seed=6), lineage("corrupt", 3))
    _rewrite(store, ref.key, other)
    with pytest.raises(CorruptBatchError, match="index"):
        store.read("corrupt", 3)


def _publish_as_version(store: BatchStore, table: pa.Table, version: int) -> None:
    """Store `table` as if an older vime wrote it with schema `version`."""
    meta = {k: v for k, v in table.schema.metadata.items() if k != b"checksum"}
    meta[b"schema_version"] = str(version).encode()
    table = table.replace_schema_metadata(meta)
    checksum = table_checksum(table)
    table = table.replace_schema_metadata({**meta, b"checksum": json.dumps(checksum).encode()})
    key = layout.batch_key("old", 1, checksum)
    _rewrite(store, key, table)
    store.batch_index.publish(index_row(table, key, 0))


def test_older_schema_version_is_refused_clearly_or_upgraded(store_uri, monkeypatch):
    """A version with no upgrade is refused naming both versions; the upgrades a version has are
    applied in turn (here 0 -> 1 -> SCHEMA_VERSION: 0 without session_id, the later ones' own)."""
    store = BatchStore(store_uri)
    current = batch_to_table(synthetic_batch(seed=7), lineage("old", 1))
    v1_columns = [name for name in COLUMNS if name != "routed_experts"]  # version 2 added routed_experts
    _publish_as_version(store, current.drop_columns(["session_id", "routed_experts"]), 0)
    with pytest.raises(SchemaVersionError, match=rf"schema version 0.*reads version {SCHEMA_VERSION}"):
        store.read("old", 1)

    def add_session_id(table: pa.Table) -> pa.Table:
        field = BATCH_SCHEMA.field("session_id")
        table = table.add_column(v1_columns.index("session_id"), field, pa.array(["s"] * table.num_rows))
        return table.replace_schema_metadata({**table.schema.metadata, b"schema_version": b"1"})

    monkeypatch.setitem(UPGRADES, 0, add_session_id)
    batch, _ = store.read("old", 1)
    assert batch["session_id"] == ["s"] * current.num_rows
    assert batch["tokens"] == current.column("tokens").to_pylist()
    assert batch["routed_experts"] == [None] * current.num_rows  # version 1 -> 2: no routing recorded


@pytest.mark.slow
def test_credentials_absent_from_logs_errors_and_metadata(s3_env, caplog, capfd, monkeypatch):
    uri = s3_env.storage_uri("creds")
    caplog.set_level(logging.INFO)
    caplog.set_level(logging.DEBUG, logger="vime_core")
    store = BatchStore(uri)
    ref = store.write(
        synthetic_batch(seed=8), lineage("creds", 0, config={"storage_uri": uri, "note": TEST_SECRET_KEY})
    )
    store.read("creds", 0)
    store.compact()
    logging.getLogger("vime_core").info("store: %r", store)
    messages = []
    with pytest.raises(BatchExistsError) as exists:
        store.write(synthetic_batch(seed=8), lineage("creds", 0))
    messages.append(str(exists.value))
    with pytest.raises(ValueError) as in_uri:
        BatchStore(f"s3://{TEST_ACCESS_KEY}:{TEST_SECRET_KEY}@vime-test/x")
    messages.append(str(in_uri.value))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-wrong-secret-value")
    with pytest.raises(PermissionError) as denied:
        BatchStore(uri, storage_options={"skip_instance_cache": True}).read("creds", 0)
    messages.append(str(denied.value))
    out, err = capfd.readouterr()
    raw_object = store.location.get(ref.key)
    assert caplog.records, "nothing was logged: the test would prove nothing"
    for secret in (TEST_SECRET_KEY, TEST_ACCESS_KEY, "a-wrong-secret-value"):
        assert secret not in caplog.text
        assert secret not in out + err
        assert all(secret not in m for m in messages)
    assert TEST_SECRET_KEY.encode() not in raw_object and TEST_ACCESS_KEY.encode() not in raw_object


def _untrainable(batch: dict, row: int) -> dict:
    """`batch` with row `row` as an engine that died left it: no response (stored before the
    trainability check existed)."""
    bad = {k: list(v) for k, v in batch.items()}
    p = bad["prompt_length"][row]
    bad["tokens"][row] = bad["tokens"][row][:p]
    bad["response_length"][row], bad["total_length"][row] = 0, p
    bad["loss_mask"][row], bad["rollout_log_probs"][row] = [], []
    bad["status"][row] = "failed"
    return bad


def test_an_untrainable_stored_batch_is_quarantined_then_replaced(store_uri, capsys):
    from flows.cli import cmd_lineage
    from vime_core.cluster.batch_io import usable_stored
    from vime_core.config import VimeConfig

    store = BatchStore(store_uri)
    cfg = VimeConfig(storage_uri=store_uri, run_name="run-q")
    good = synthetic_batch(num_groups=2, group_size=4, seed=3)
    store.write(_untrainable(good, 5), lineage("run-q", 9))
    store.write(good, lineage("run-q", 10))
    old = store.ref("run-q", 9)

    assert usable_stored(cfg, 10) == (True, None)
    assert usable_stored(cfg, 11) == (False, None)  # nothing stored: generated, nothing quarantined
    usable, record = usable_stored(cfg, 9)
    assert not usable and "UntrainableBatchError" in record["reason"] and "sample 5" in record["reason"]
    assert record["key"] == old.key and record["checksum"] == old.checksum
    # kept aside byte for byte, and still published until the regenerated batch replaces it
    assert store.location.get(record["quarantined_key"]) == store.location.get(old.key)
    assert store.exists("run-q", 9)
    assert [(r["run"], r["rollout_id"]) for r in store.quarantined("run-q")] == [("run-q", 9)]

    store.write(good, lineage("run-q", 9), overwrite=True)
    assert usable_stored(cfg, 9) == (True, None)
    assert store.location.get(record["quarantined_key"]) is not None  # the quarantined copy stays
    assert cmd_lineage(["--storage-uri", store_uri, "--run", "run-q", "--quarantined"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [r["rollout_id"] for r in shown] == [9] and "response_length=0" in shown[0]["reason"]


def test_a_configurations_s3_endpoint_is_read_once_and_reaches_the_server_without_the_variable(s3_env, monkeypatch):
    from vime_core.config import VimeConfig

    cfg = VimeConfig(storage_uri=s3_env.storage_uri("from-config"))  # made where AWS_ENDPOINT_URL is set
    monkeypatch.delenv("AWS_ENDPOINT_URL")  # e.g. a Ray node started without it
    assert cfg.storage_endpoint_url == s3_env.endpoint
    ref = BatchStore.for_config(cfg).write(synthetic_batch(seed=3), lineage("cfg", 0))
    assert BatchStore.for_config(cfg).list_batches("cfg") == [ref]
    # the same URI without the configuration's endpoint means AWS itself (nothing is contacted here)
    assert BatchStore(cfg.storage_uri).location.endpoint == ""


def test_a_store_in_a_hidden_folder_lists_its_batches(tmp_path):
    """A store under ~/.cache/... (a dot folder above the store's root) sees what it wrote: only
    hidden names below the root are partial uploads to leave out of a listing."""
    uri = str(tmp_path / ".cache" / "vime" / "runs")
    store = BatchStore(uri)
    for rollout_id in range(2):
        store.write(
            synthetic_batch(num_groups=2, group_size=2, max_response_len=8, seed=rollout_id), lineage("r", rollout_id)
        )
    store.location.put(f"{layout.TMP}/r/.upload.partial", b"half")
    again = BatchStore(uri)  # a resumed run's store: what it knows comes from the listing
    assert [ref.rollout_id for ref in again.list_batches("r")] == [0, 1]
    keys = again.location.list_keys("")
    assert sorted(k for k in keys if k.startswith(f"{layout.BATCHES}/")) == sorted(
        r.key for r in again.list_batches("r")
    )
    assert not [k for k in keys if "/." in f"/{k}"]


@pytest.mark.parametrize("root", ["exp[1]/runs", "runs*", "s3://bucket/exp?"])
def test_a_root_fsspec_would_read_as_a_glob_is_refused_naming_it(tmp_path, root):
    """fsspec expands [ ] * ? in the paths of a multi-key read: such a root would store its first
    batch, then fail every index read after it. It is refused before anything is written."""
    uri = root if "://" in root else str(tmp_path / root)
    with pytest.raises(ValueError, match=r"storage URI .* holds .* glob pattern: choose a folder or prefix without"):
        BatchStore(uri)
    assert list(tmp_path.iterdir()) == []
