"""The pure parts of storage: schema mapping, lineage, checksum, upgrades, redaction, layout."""

from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from vime_core.data.sample import Status, WeightSpan
from vime_core.storage import layout
from vime_core.storage.index import index_row, latest_per_batch
from vime_core.storage.schema import (
    BATCH_SCHEMA,
    COLUMNS,
    SCHEMA_VERSION,
    UPGRADES,
    SchemaError,
    SchemaVersionError,
    batch_to_table,
    describe_schema,
    lineage_of,
    stored_schema_version,
    table_checksum,
    table_to_batch,
    upgrade_table,
)
from vime_core.utils.secrets import REDACTED, redact_secrets, redact_text
from vime_core.storage.synthetic import synthetic_batch

LINEAGE = {
    "run": "unit",
    "rollout_id": 3,
    "config_hash": "abc",
    "config": json.dumps({"lr": 1e-6}),
    "flow_run_id": "f-1",
}


def _parquet_round_trip(table: pa.Table) -> pa.Table:
    sink = io.BytesIO()
    pq.write_table(table, sink)
    return pq.read_table(io.BytesIO(sink.getvalue()))


def test_round_trip_is_exact_through_parquet():
    batch = synthetic_batch(num_groups=3, group_size=4, seed=7)
    table = _parquet_round_trip(batch_to_table(batch, LINEAGE))
    back, lineage = table_to_batch(table)
    assert back == batch
    assert table.schema.equals(batch_to_table(batch, LINEAGE).schema, check_metadata=False)
    assert lineage["run"] == "unit" and lineage["rollout_id"] == 3
    assert lineage["num_rows"] == len(batch["prompt_id"])
    assert lineage["schema_version"] == SCHEMA_VERSION
    assert lineage["checksum"] == table_checksum(table)


def test_computed_lineage_comes_from_the_batch():
    batch = synthetic_batch(num_groups=3, group_size=2, weight_version=5, seed=1)
    lineage = lineage_of(batch_to_table(batch, LINEAGE))
    expected_versions = sorted({s["version"] for spans in batch["weight_versions"] for s in spans})
    expected_prompts = [batch["prompt_id"][i] for i in range(len(batch["prompt_id"])) if batch["index"][i] == 0]
    assert lineage["weight_versions"] == expected_versions
    assert lineage["prompt_ids"] == expected_prompts
    assert lineage["code_version"]  # computed from git or the package
    assert lineage["created_at"].endswith("+00:00")


def test_enums_dataclass_spans_and_dict_metadata_are_normalised():
    batch = synthetic_batch(num_groups=1, group_size=2, seed=2)
    batch["status"] = [Status.COMPLETED, Status.TRUNCATED]
    batch["weight_versions"] = [[WeightSpan(1, 0, n)] for n in batch["response_length"]]
    batch["metadata"] = [{"b": 1, "a": 2}, {}]
    back, _ = table_to_batch(batch_to_table(batch, LINEAGE))
    assert back["status"] == ["completed", "truncated"]
    assert back["weight_versions"] == [[{"version": 1, "start": 0, "end": n}] for n in batch["response_length"]]
    assert back["metadata"] == ['{"a": 2, "b": 1}', "{}"]


def test_log_probs_are_stored_as_float32():
    batch = synthetic_batch(num_groups=1, group_size=1, seed=3)
    n = batch["response_length"][0]
    batch["rollout_log_probs"] = [[-0.1] * n]
    back, _ = table_to_batch(batch_to_table(batch, LINEAGE))
    assert back["rollout_log_probs"][0] == [float(np.float32(-0.1))] * n


def test_checksum_ignores_chunking_and_slicing_but_not_values_or_lineage():
    table = batch_to_table(synthetic_batch(seed=4), LINEAGE)
    doubled = pa.concat_tables([table, table])
    assert table_checksum(doubled.slice(table.num_rows, table.num_rows)) == table_checksum(table)
    tokens = table.column("tokens").to_pylist()
    tokens[0][0] += 1
    changed = table.set_column(
        COLUMNS.index("tokens"), BATCH_SCHEMA.field("tokens"), pa.array(tokens, BATCH_SCHEMA.field("tokens").type)
    )
    assert table_checksum(changed) != table_checksum(table)
    meta = dict(table.schema.metadata)
    meta[b"flow_run_id"] = json.dumps("someone-else").encode()
    assert table_checksum(table.replace_schema_metadata(meta)) != table_checksum(table)


@pytest.mark.parametrize(
    "mutate, column",
    [
        (lambda b: b.pop("advantage"), "advantage"),
        (lambda b: b.__setitem__("extra", [0] * len(b["prompt_id"])), "extra"),
        (lambda b: b["reward"].pop(), "reward"),
        (lambda b: b["tokens"].__setitem__(0, ["x"]), "tokens"),
        (lambda b: b["status"].__setitem__(0, None), "status"),
        (lambda b: b["total_length"].__setitem__(1, b["total_length"][1] + 1), "total_length"),
        (lambda b: b["loss_mask"][2].append(1), "loss_mask"),
        (lambda b: b["rollout_log_probs"][0].append(-1.0), "rollout_log_probs"),
    ],
)
def test_bad_batches_are_refused_naming_the_column(mutate, column):
    batch = synthetic_batch(seed=5)
    mutate(batch)
    with pytest.raises(SchemaError, match=column):
        batch_to_table(batch, LINEAGE)


@pytest.mark.parametrize(
    "lineage, word",
    [
        ({"rollout_id": 1}, "run"),
        ({"run": "r"}, "rollout_id"),
        ({"run": "r", "rollout_id": -1}, "rollout_id"),
        ({"run": "r", "rollout_id": 1, "colour": "red"}, "colour"),
        ({"run": "r", "rollout_id": 1, "config": "{not json"}, "config"),
    ],
)
def test_bad_lineage_is_refused_naming_the_key(lineage, word):
    with pytest.raises(SchemaError, match=word):
        batch_to_table(synthetic_batch(), lineage)


def test_credentials_never_reach_the_metadata(monkeypatch):
    secret = "s3cr3t-value-" + "x" * 20
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    config = {
        "storage_uri": f"s3://AKIDEXAMPLE:{secret}@bucket/p",
        "notes": f"echo {secret}",
        "aws_secret_access_key": "other",
        "max_tokens_per_gpu": 4096,
    }
    table = batch_to_table(synthetic_batch(), {**LINEAGE, "config": config, "model_id": secret})
    blob = b"".join(k + v for k, v in table.schema.metadata.items())
    assert secret.encode() not in blob and b"other" not in blob
    stored = json.loads(lineage_of(table)["config"])
    assert stored["max_tokens_per_gpu"] == 4096  # a `tokens` key is not a credential
    assert stored["aws_secret_access_key"] == REDACTED


def test_redaction_rules():
    assert redact_text("s3://user:pw@host/x", secrets=[]) == f"s3://user:{REDACTED}@host/x"
    assert redact_secrets({"password": "", "api_key": None, "nested": [{"token": "t"}]}, secrets=[]) == {
        "password": "",
        "api_key": None,
        "nested": [{"token": REDACTED}],
    }


def _as_version(table: pa.Table, version: int) -> pa.Table:
    """The same table claiming another schema version, with a valid checksum."""
    meta = {k: v for k, v in table.schema.metadata.items() if k != b"checksum"}
    meta[b"schema_version"] = str(version).encode()
    table = table.replace_schema_metadata(meta)
    return table.replace_schema_metadata({**meta, b"checksum": json.dumps(table_checksum(table)).encode()})


def test_older_version_without_upgrade_is_refused_naming_both_versions(monkeypatch):
    monkeypatch.delitem(UPGRADES, SCHEMA_VERSION - 1)
    old = _as_version(batch_to_table(synthetic_batch(), LINEAGE), SCHEMA_VERSION - 1)
    with pytest.raises(SchemaVersionError, match=rf"version {SCHEMA_VERSION - 1}.*reads version {SCHEMA_VERSION}"):
        upgrade_table(old, source="batch X")
    newer = _as_version(batch_to_table(synthetic_batch(), LINEAGE), SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match="newer"):
        upgrade_table(newer)


def test_older_version_with_an_upgrade_is_read(monkeypatch):
    """A made-up older version that lacked `session_id`; the upgrade fills it with ''."""
    current = batch_to_table(synthetic_batch(seed=8), LINEAGE)
    old = _as_version(current.drop_columns(["session_id"]), SCHEMA_VERSION - 1)

    def add_session_id(table: pa.Table) -> pa.Table:
        position = COLUMNS.index("session_id")
        upgraded = table.add_column(position, BATCH_SCHEMA.field("session_id"), pa.array([""] * table.num_rows))
        meta = dict(table.schema.metadata)
        meta[b"schema_version"] = str(SCHEMA_VERSION).encode()
        return upgraded.replace_schema_metadata(meta)

    monkeypatch.setitem(UPGRADES, SCHEMA_VERSION - 1, add_session_id)
    batch, _ = table_to_batch(upgrade_table(old))
    assert batch["session_id"] == [""] * current.num_rows
    assert batch["tokens"] == current.column("tokens").to_pylist()


def test_index_row_summarises_the_batch():
    batch = synthetic_batch(num_groups=2, group_size=3, weight_version=4, seed=9)
    table = batch_to_table(batch, LINEAGE)
    row = index_row(table, "batches/unit/x.parquet", 123).to_pylist()[0]
    versions = sorted({s["version"] for spans in batch["weight_versions"] for s in spans})
    assert (row["weight_version_min"], row["weight_version_max"]) == (versions[0], versions[-1])
    assert row["reward_mean"] == pytest.approx(sum(batch["raw_reward"]) / len(batch["raw_reward"]))
    assert row["prompt_ids"] == ["p0", "p1"] and row["size_bytes"] == 123


def test_latest_per_batch_keeps_the_row_published_last():
    """Even when the newer batch claims an older created_at (a caller may set it)."""
    table = batch_to_table(synthetic_batch(), LINEAGE)
    old = index_row(
        table.replace_schema_metadata({**table.schema.metadata, b"created_at": b'"2999-01-01T00:00:00+00:00"'}),
        "old",
        1,
    )
    new = index_row(table, "new", 1)
    assert new["published_at"][0].as_py() > old["published_at"][0].as_py()
    kept = latest_per_batch(pa.concat_tables([new, old, old]))
    assert kept.column("key").to_pylist() == ["new"]


def test_a_tombstone_hides_a_row_whose_publisher_clock_ran_ahead():
    """The machine that published the row may have a clock ahead of the one that removes it."""
    import datetime as dt

    from vime_core.storage.index import published, tombstone_row

    row = index_row(batch_to_table(synthetic_batch(), LINEAGE), "k", 1)
    ahead = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=5)
    at = row.schema.get_field_index("published_at")
    row = row.set_column(at, row.schema.field(at), pa.array([ahead], row.schema.field(at).type))
    tombstone = tombstone_row(row.to_pylist()[0])
    assert tombstone["published_at"][0].as_py() > ahead and tombstone["unpublished"][0].as_py()
    assert published(pa.concat_tables([tombstone, row])).num_rows == 0


def test_index_files_of_versions_1_and_2_are_read_and_other_versions_refused_naming_them():
    import pyarrow.compute as pc

    from vime_core.storage.index import INDEX_SCHEMA, INDEX_VERSION, _as_index_table

    row = index_row(batch_to_table(synthetic_batch(), LINEAGE), "k", 1)
    assert _as_index_table(row, "index/ok.parquet").num_rows == 1
    # stamped 1 by the vime that had already added published_at: read as it is
    stamped_1 = row.replace_schema_metadata({b"index_version": b"1"})
    assert _as_index_table(stamped_1, "index/v1.parquet").equals(row.cast(INDEX_SCHEMA))
    # version 1 proper (no published_at, no stamp or stamp 1): published_at is the creation time
    for metadata in ({b"index_version": b"1"}, None):
        v1 = row.drop_columns(["published_at"]).replace_schema_metadata(metadata)
        upgraded = _as_index_table(v1, "index/v1.parquet")
        assert upgraded.schema.names == INDEX_SCHEMA.names
        assert pc.all(pc.equal(upgraded["published_at"], upgraded["created_at"])).as_py()
        assert not pc.any(upgraded["unpublished"]).as_py()
    # version 2 (no tombstones): every row published
    v2 = row.drop_columns(["unpublished"]).replace_schema_metadata({b"index_version": b"2"})
    assert _as_index_table(v2, "index/v2.parquet").equals(row.cast(INDEX_SCHEMA))
    newer = row.replace_schema_metadata({b"index_version": str(INDEX_VERSION + 1).encode()})
    with pytest.raises(
        ValueError, match=f"index/new.parquet was written by a newer vime \\(index version {INDEX_VERSION + 1}\\)"
    ):
        _as_index_table(newer, "index/new.parquet")
    with pytest.raises(ValueError, match="index/fields.parquet was written by index version"):
        _as_index_table(row.drop_columns(["prompt_ids"]), "index/fields.parquet")


@pytest.mark.parametrize("run", ["", "../x", "a/b", "-x", "a" * 64])
def test_layout_refuses_unsafe_run_names(run):
    with pytest.raises(ValueError, match="run name"):
        layout.batch_key(run, 0, "0" * 64)


def test_describe_schema_lists_every_column():
    text = describe_schema()
    assert all(f"| {c} |" in text for c in COLUMNS)


@pytest.mark.parametrize("name, marker", [("interfaces.md", "columns:begin"), ("lineage.md", "schema:begin")])
def test_generated_doc_sections_are_current(name, marker):
    """docs/interfaces.md's column table and docs/lineage.md's schema are generated from
    vime_core/data/columns.py (and the index schema); a stale one fails here."""
    from pathlib import Path

    from vime_core.storage.docs import render_into

    text = (Path(__file__).resolve().parents[2] / "docs" / name).read_text()
    assert marker in text
    assert render_into(text) == text, "run: python -m vime_core.storage.docs --write docs/interfaces.md docs/lineage.md"


def test_a_changed_column_makes_the_docs_stale(monkeypatch):
    """The check above can fail: a meaning edited in the one definition changes the table."""
    import dataclasses
    from pathlib import Path

    from vime_core.data import columns
    from vime_core.storage import docs

    edited = tuple(
        dataclasses.replace(c, meaning=c.meaning + " (edited)") if c.name == "tokens" else c
        for c in columns.BATCH_COLUMNS
    )
    monkeypatch.setattr(docs, "BATCH_COLUMNS", edited)
    text = (Path(__file__).resolve().parents[2] / "docs" / "interfaces.md").read_text()
    assert docs.render_into(text) != text and "| prompt + response token ids (edited) |" in docs.render_into(text)


def test_the_real_batch_builder_output_round_trips():
    """build_batch (vime_core.data.batch) produces exactly the columns the schema stores."""
    from vime_core.config import load_config
    from vime_core.data.batch import build_batch
    from vime_core.data.sample import Sample

    samples = []
    for g in range(2):
        for i in range(3):
            s = Sample(prompt_id=f"p{g}", tokens=[1, 2, 3], prompt_length=3, group_index=g, index=i, session_id=f"s{g}")
            s.append_response_tokens([4, 5, 6][: i + 1], [-0.5, -0.25, -2.0][: i + 1])
            s.reward, s.status, s.finish_reason = float(i % 2), Status.COMPLETED, "stop"
            s.weight_versions = [WeightSpan(1, 0, i + 1)]
            samples.append(s)
    batch = build_batch(samples, load_config())
    back, _ = table_to_batch(_parquet_round_trip(batch_to_table(batch, LINEAGE)))
    assert back == batch


def test_numpy_integer_rollout_ids_are_accepted():
    lineage = lineage_of(batch_to_table(synthetic_batch(), {"run": "r", "rollout_id": np.int64(4)}))
    assert lineage["rollout_id"] == 4 and layout.check_rollout_id(np.int32(4)) == 4


def test_a_batch_stored_by_schema_version_1_still_verifies_and_reads():
    """tests/unit/data/rollout_batch_v1.parquet was written by this code at schema version 1
    (synthetic_batch(num_groups=2, group_size=2, seed=123)). It keeps the checksum definition
    honest across pyarrow upgrades (the IPC bytes must not drift) and, once SCHEMA_VERSION moves
    on, proves that UPGRADES still read version 1."""
    from pathlib import Path

    from vime_core.storage.store import verify_table

    path = Path(__file__).parent / "data" / "rollout_batch_v1.parquet"
    table = upgrade_table(verify_table(path.read_bytes(), str(path)), source=str(path))
    batch, lineage = table_to_batch(table)
    assert lineage["run"] == "golden" and lineage["rollout_id"] == 1
    assert batch == synthetic_batch(num_groups=2, group_size=2, seed=123)


def test_routed_experts_keep_their_bytes_type_and_checksum_through_parquet():
    from vime_core.data import routed_experts

    batch = synthetic_batch(num_groups=2, group_size=2, seed=5)
    rng = np.random.default_rng(5)
    for i, tokens in enumerate(batch["tokens"]):
        if i:  # sample 0 recorded none: null
            rows = rng.integers(0, 128, (len(tokens) - 1, 3, 4), dtype=np.uint8)
            batch["routed_experts"][i] = routed_experts.encode(rows)
    table = batch_to_table(batch, LINEAGE)
    stored = _parquet_round_trip(table)
    assert stored.schema.field("routed_experts").type == pa.large_binary()
    assert table_checksum(stored) == lineage_of(table)["checksum"]
    back, _ = table_to_batch(stored)
    assert back["routed_experts"] == batch["routed_experts"] and back["routed_experts"][0] is None
    assert routed_experts.decode(back["routed_experts"][1]).shape == (len(batch["tokens"][1]) - 1, 3, 4)


def test_version_1_reads_with_a_null_routed_experts_column():
    current = batch_to_table(synthetic_batch(seed=9), LINEAGE)
    v1 = _as_version(current.drop_columns(["routed_experts"]), 1)
    upgraded = upgrade_table(v1)
    assert upgraded.schema.names == list(COLUMNS) and stored_schema_version(upgraded) == SCHEMA_VERSION
    batch, _ = table_to_batch(upgraded)
    assert batch["routed_experts"] == [None] * current.num_rows
    assert batch["tokens"] == current.column("tokens").to_pylist()
