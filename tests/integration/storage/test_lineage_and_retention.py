"""Lineage queries answer from the index alone; pyarrow.dataset reads the index folder; prune and
orphan removal (local folder and real S3)."""

from __future__ import annotations

import datetime as dt

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pytest

from vime_core.storage import BatchNotFoundError, BatchStore
from vime_core.storage import layout, lineage
from vime_core.storage.index import published
from vime_core.storage.retention import parse_age, remove_orphans
from vime_core.storage.synthetic import synthetic_batch

pytestmark = pytest.mark.timeout(120)

NOW = dt.datetime.now(dt.timezone.utc)


def _fill(store: BatchStore) -> dict[int, dict]:
    """Run "lin": rollout k at weights k+1 (some samples straddle into k+2); prompts p0..p3 in
    every rollout, and q0 used again in rollout 2. Run "other": one batch, 10 days old."""
    batches = {}
    for k in range(4):
        batch = synthetic_batch(num_groups=4, group_size=2, weight_version=k + 1, seed=k)
        if k == 2:
            extra = synthetic_batch(num_groups=1, group_size=2, weight_version=k + 1, seed=50, prompt_prefix="q")
            for column, values in extra.items():
                batch[column] = batch[column] + ([g + 4 for g in values] if column == "group_index" else values)
        batches[k] = batch
        store.write(batch, {"run": "lin", "rollout_id": k, "config_hash": "c1" if k < 2 else "c2"})
    store.write(
        synthetic_batch(num_groups=1, group_size=2, seed=9, prompt_prefix="q"),
        {"run": "other", "rollout_id": 0, "created_at": (NOW - dt.timedelta(days=10)).isoformat()},
    )
    return batches


def _delete_batch_objects(store: BatchStore) -> None:
    for key in store.location.list_keys(layout.BATCHES):
        store.location.delete(key)


def test_lineage_queries_answer_from_the_index_alone(store_uri):
    store = BatchStore(store_uri)
    batches = _fill(store)
    _delete_batch_objects(store)  # any batch read would now fail: the answers come from the index
    index = store.index()

    for version in range(1, 7):
        expected = sorted(
            k
            for k, b in batches.items()
            if any(s["version"] == version for spans in b["weight_versions"] for s in spans)
        )
        got = lineage.batches_by_weight_version(index, version, run="lin").column("rollout_id").to_pylist()
        assert got == expected, version

    seen = lineage.prompt_use_counts(index, run="lin", min_count=2)
    uses: dict[str, list[int]] = {}
    for k, b in batches.items():
        for i, prompt in enumerate(b["prompt_id"]):
            if b["index"][i] == 0:
                uses.setdefault(prompt, []).append(k)
    expected_seen = {p: ks for p, ks in uses.items() if len(ks) >= 2}
    assert {r["prompt_id"]: (r["count"], r["rollout_ids"]) for r in seen.to_pylist()} == {
        p: (len(ks), sorted(set(ks))) for p, ks in expected_seen.items()
    }
    assert "q0" not in expected_seen  # used once in this run (and once in run "other")

    curve = lineage.reward_by_iteration(index, "lin").to_pylist()
    assert [r["rollout_id"] for r in curve] == [0, 1, 2, 3]
    for row in curve:
        rewards = batches[row["rollout_id"]]["raw_reward"]
        assert row["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert row["num_rows"] == len(rewards)
    assert lineage.batches_of_config(index, "c2").column("rollout_id").to_pylist() == [2, 3]
    # A store works as the source too (its index is read once per call).
    assert lineage.prompts_seen_twice(store, run="lin").equals(seen)
    assert lineage.batches_by_weight_version(store, 2).equals(lineage.batches_by_weight_version(index, 2))
    with pytest.raises(BatchNotFoundError):
        store.read("lin", 0)  # the object really is gone


def test_index_folder_is_a_parquet_dataset(store_uri):
    """The documented query: pyarrow.dataset over <store>/index, without vime's reader."""
    store = BatchStore(store_uri)
    _fill(store)
    store.compact()
    store.write(synthetic_batch(seed=77), {"run": "lin", "rollout_id": 4})  # a manifest beside the compacted file
    store.discard("lin", 3, "rejected")  # a tombstone beside the row it hides
    dataset = ds.dataset(store.location.path("index"), format="parquet", filesystem=store.location.fs)
    table = published(dataset.to_table())
    assert table.equals(store.index()) and 3 not in table.column("rollout_id").to_pylist()
    v2 = table.filter(
        pc.and_(pc.less_equal(table["weight_version_min"], 2), pc.greater_equal(table["weight_version_max"], 2))
    )
    assert set(v2.column("rollout_id").to_pylist()) >= {0, 1}


def test_prune_by_run_and_age(store_uri):
    store = BatchStore(store_uri)
    _fill(store)
    with pytest.raises(ValueError, match="run or an age"):
        store.prune()
    planned = store.prune(older_than="7d")
    assert [(r.run, r.rollout_id) for r in planned] == [("other", 0)]
    assert store.exists("other", 0), "dry run removed something"
    removed = store.prune(older_than="7d", dry_run=False)
    assert [(r.run, r.rollout_id) for r in removed] == [("other", 0)]
    assert not store.exists("other", 0)
    assert removed[0].key not in store.location.list_keys("")
    assert store.index().column("run").unique().to_pylist() == ["lin"]
    store.prune(run="lin", older_than=NOW - dt.timedelta(days=1), dry_run=False)  # nothing that old
    assert store.index().num_rows == 4
    removed = store.prune(run="lin", dry_run=False)
    assert len(removed) == 4 and store.index().num_rows == 0
    assert store.location.list_keys(layout.BATCHES) == []
    assert store.location.list_keys(layout.MANIFESTS) == []


def test_remove_orphans_keeps_young_and_published_objects(store_uri):
    store = BatchStore(store_uri)
    ref = store.write(synthetic_batch(seed=1), {"run": "orph", "rollout_id": 0})
    store.location.put(layout.tmp_key("orph", 1), b"partial upload")
    store.location.put(layout.batch_key("orph", 2, "f" * 64), b"never indexed")
    assert remove_orphans(store, older_than="1h") == []  # too young: a writer may still publish them
    orphans = remove_orphans(store, older_than=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1), dry_run=False)
    assert len(orphans) == 2 and ref.key not in orphans
    assert store.location.list_keys(layout.TMP) == []
    assert store.read("orph", 0)[0] == synthetic_batch(seed=1)


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600)])
def test_parse_age(text, seconds):
    assert parse_age(text).total_seconds() == seconds


def test_parse_age_refuses_garbage():
    with pytest.raises(ValueError, match="7d"):
        parse_age("seven days")


def _three_compacted(store: BatchStore, run: str) -> None:
    """Batches 0, 1, 2 of `run`, their rows in a compacted file (an earlier compaction)."""
    for k in range(3):
        store.write(synthetic_batch(num_groups=1, group_size=2, seed=k), {"run": run, "rollout_id": k})
    store.compact()


def _remove(store: BatchStore, remove: str, run: str) -> list[int]:
    """Prune every batch of `run`, or discard its batch 1; the rollout ids left listed after it."""
    if remove == "prune":
        store.prune(run=run, dry_run=False)
        return []
    store.discard(run, 1, "rejected")
    return [0, 2]


@pytest.mark.parametrize("fail_at", ["tombstone", "delete"])
@pytest.mark.parametrize("remove", ["prune", "discard"])
def test_a_removal_cut_short_never_lists_a_batch_without_its_object(store_uri, monkeypatch, remove, fail_at):
    """A removal that fails writing its tombstones changes nothing; one that fails after them, deleting
    the objects, has unlisted the batches it removes and leaves their objects to remove_orphans:
    never a listed batch without its object."""
    from vime_core.storage.index import BatchIndex

    store = BatchStore(store_uri)
    _three_compacted(store, "cut")
    before = set(store.location.list_keys(layout.BATCHES))

    def fail(*args, **kwargs):
        raise ConnectionError("the store went away")

    with monkeypatch.context() as patched:
        if fail_at == "tombstone":
            patched.setattr(BatchIndex, "unpublish", fail)
        else:
            patched.setattr(type(store.location), "delete", fail)
        with pytest.raises(ConnectionError):
            _remove(store, remove, "cut")
    listed = [r.rollout_id for r in store.list_batches("cut")]
    for rollout_id in listed:
        store.read("cut", rollout_id)  # published, so whole
    if fail_at == "tombstone":
        assert listed == [0, 1, 2]
        assert _remove(store, remove, "cut") == [r.rollout_id for r in store.list_batches("cut")]
        return
    assert listed == ([] if remove == "prune" else [0, 2])
    assert set(store.location.list_keys(layout.BATCHES)) == before  # the objects wait for remove_orphans
    orphans = remove_orphans(store, older_than=NOW + dt.timedelta(hours=1), dry_run=False)
    assert len(orphans) == len(before) - len(listed)
    for rollout_id in listed:
        store.read("cut", rollout_id)


@pytest.mark.parametrize("remove", ["prune", "discard"])
def test_a_compaction_that_read_the_index_before_a_removal_does_not_bring_it_back(store_uri, remove):
    """Another process's compaction lists the index, then a removal and a compaction run, then that
    compaction writes what it read (with the removed rows) and deletes the files it read: the
    removed batches stay out of the index, then and after later compactions, and every listed
    batch reads."""
    store = BatchStore(store_uri)
    _three_compacted(store, "race")
    store.write(synthetic_batch(seed=7), {"run": "race-other", "rollout_id": 0})  # a manifest: two files to fold
    stale = store.batch_index.snapshot()  # the other compaction has read the index
    kept = _remove(store, remove, "race")
    store.compact()  # a compaction after the removal folds its tombstones
    store.batch_index.fold(*stale)  # ... then the other one writes what it read
    for _ in range(2):
        assert [r.rollout_id for r in store.list_batches("race")] == kept
        assert not store.exists("race", 1) and store.exists("race-other", 0)
        for rollout_id in kept:
            store.read("race", rollout_id)
        store.compact()


def test_a_batch_stored_again_after_its_removal_is_listed_whatever_the_clocks(store_uri, monkeypatch):
    """The run guard discards a batch and the rollout is generated and stored again, perhaps on a
    machine whose clock is behind the remover's: the new row still comes after the tombstone."""
    import vime_core.storage.index as index

    store = BatchStore(store_uri)
    store.write(synthetic_batch(seed=1), {"run": "clock", "rollout_id": 0})
    real_now = index._published_now
    ahead = dt.timedelta(minutes=10)
    with monkeypatch.context() as patched:
        patched.setattr(index, "_published_now", lambda after: real_now(after) + ahead)  # the remover's clock
        store.discard("clock", 0, "rejected")
    assert not store.exists("clock", 0)
    again = store.write(synthetic_batch(seed=2), {"run": "clock", "rollout_id": 0})  # not an overwrite
    assert store.exists("clock", 0) and store.read("clock", 0)[0] == synthetic_batch(seed=2)
    store.compact()
    assert [r.key for r in store.list_batches("clock")] == [again.key]


def test_a_compaction_drops_tombstones_once_they_are_old(store_uri, monkeypatch):
    import vime_core.storage.index as index

    store = BatchStore(store_uri)
    _three_compacted(store, "old")
    store.discard("old", 1, "rejected")
    store.compact()
    rows = store.batch_index.snapshot()[1]
    assert rows.num_rows == 3 and rows.filter(rows["unpublished"]).column("rollout_id").to_pylist() == [1]
    monkeypatch.setattr(index, "TOMBSTONE_KEEP", dt.timedelta(0))
    store.write(synthetic_batch(seed=5), {"run": "old", "rollout_id": 3})  # something to fold
    store.compact()
    rows = store.batch_index.snapshot()[1]
    assert rows.column("rollout_id").to_pylist() == [0, 2, 3] and not pc.any(rows["unpublished"]).as_py()
    assert [r.rollout_id for r in store.list_batches("old")] == [0, 2, 3]


def test_an_indexed_batch_whose_object_is_gone_is_generated_again(store_uri):
    """usable_stored: a row left in the index without its object (an older vime's removal cut
    short) is quarantined, so the rollout is generated again and overwrites it, not a failed task."""
    from vime_core.cluster.batch_io import usable_stored
    from vime_core.config import make_config

    cfg = make_config({"storage_uri": store_uri, "run_name": "gone"})
    store = BatchStore(store_uri)
    ref = store.write(synthetic_batch(num_groups=1, group_size=2, seed=3), {"run": "gone", "rollout_id": 0})
    store.location.delete(ref.key)
    usable, record = usable_stored(cfg, 0)
    assert not usable and record["reason"].startswith("BatchNotFoundError") and record["quarantined_key"] is None
    again = store.write(
        synthetic_batch(num_groups=1, group_size=2, seed=4), {"run": "gone", "rollout_id": 0}, overwrite=True
    )
    assert store.read("gone", 0)[0] == synthetic_batch(num_groups=1, group_size=2, seed=4) and again.key != ref.key
