"""What a run writes besides its batches goes through the storage's StorageLocation, local or
object store alike (fsspec's in-memory store stands in for S3 here; the real S3 server is in
tests/integration/storage/test_run_files_on_s3.py): the configuration, the report files, and the
HF export published as one unit (vime_core/storage/folders.py)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from vime_core.storage.folders import MANIFEST, published_folder, publish_folder, staging_dir
from vime_core.storage.fs import StorageLocation, open_location


def _memory_uri() -> str:
    return f"memory://vime-run-files-{uuid.uuid4().hex}"


def _stage(location: StorageLocation, key: str, files: dict[str, bytes]) -> Path:
    staged = staging_dir(location, key)
    for name, data in files.items():
        (staged / name).parent.mkdir(parents=True, exist_ok=True)
        (staged / name).write_bytes(data)
    return staged


def _read_folder(folder_uri: str) -> dict[str, bytes]:
    """{relative name: bytes} of every file under the published folder."""
    inside = open_location(folder_uri)
    return {key: inside.get(key) for key in inside.list_keys("")}


V1 = {"model.safetensors": b"weights one", "config.json": b'{"v": 1}', "tok/tokenizer.json": b"t1"}
V2 = {"model.safetensors": b"weights two!", "config.json": b'{"v": 2}'}


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_published_folder_replaces_the_previous_one_whole(where, tmp_path):
    location = open_location(str(tmp_path / "store") if where == "local" else _memory_uri())
    key = "exports/r"
    assert published_folder(location, key) is None
    first = publish_folder(location, key, _stage(location, key, V1), label="v1")
    assert _read_folder(published_folder(location, key)) == V1
    second = publish_folder(location, key, _stage(location, key, V2), label="v2")
    assert _read_folder(published_folder(location, key)) == V2
    if where == "local":  # renamed into place: the folder is the key itself, nothing hidden left beside it
        assert first == second == key and sorted(p.name for p in (tmp_path / "store" / "exports").iterdir()) == ["r"]
    else:  # a fresh prefix each time; the manifest names the current one and the previous is gone
        assert first != second and second.startswith(f"{key}/v2-")
        assert sorted(location.list_keys(key)) == sorted([f"{key}/{MANIFEST}"] + [f"{second}/{n}" for n in V2])


def test_on_an_object_store_the_manifest_is_the_last_write(monkeypatch):
    location = open_location(_memory_uri())
    writes: list[str] = []
    for method in ("put_file", "put_atomic", "put"):
        real = getattr(StorageLocation, method)
        monkeypatch.setattr(
            StorageLocation,
            method,
            lambda self, key, *a, _real=real, **k: (writes.append(key), _real(self, key, *a, **k))[1],
        )
    folder = publish_folder(location, "exports/r", _stage(location, "exports/r", V1), label="v1")
    assert writes[-1] == f"exports/r/{MANIFEST}"
    assert sorted(writes[:-1]) == sorted(f"{folder}/{n}" for n in V1)
    assert json.loads(location.get(f"exports/r/{MANIFEST}"))["files"] == sorted(V1)


def test_an_upload_cut_short_leaves_the_previous_folder_and_the_next_publish_removes_it(monkeypatch):
    location = open_location(_memory_uri())
    key = "exports/r"
    publish_folder(location, key, _stage(location, key, V1), label="v1")
    before = published_folder(location, key)
    real = StorageLocation.put_file
    uploaded = []

    def cut_after_one(self, k, local):
        if uploaded:
            raise ConnectionError("store went away")
        uploaded.append(k)
        return real(self, k, local)

    monkeypatch.setattr(StorageLocation, "put_file", cut_after_one)
    staged = _stage(location, key, V2)
    with pytest.raises(ConnectionError):
        publish_folder(location, key, staged, label="v2")
    assert not staged.exists()  # the local staging folder is removed either way
    assert published_folder(location, key) == before and _read_folder(before) == V1
    assert uploaded[0] in location.list_keys(key)  # the cut upload's first file is there, unnamed...
    monkeypatch.setattr(StorageLocation, "put_file", real)
    after = publish_folder(location, key, _stage(location, key, V2), label="v2")
    assert _read_folder(published_folder(location, key)) == V2
    assert all(k == f"{key}/{MANIFEST}" or k.startswith(f"{after}/") for k in location.list_keys(key))  # ...and gone


def test_a_metrics_line_is_appended_on_an_object_store_in_one_atomic_replace():
    from vime_core.report.records import append_record, read_records, report_location

    uri = _memory_uri()
    append_record(uri, "r", {"rollout_id": 0, "reward_mean": 0.1})
    reports = report_location(uri, "r")
    reports.put_atomic("metrics.jsonl", reports.get("metrics.jsonl") + b'{"rollout_id": 1, "rew')  # a cut line
    path = append_record(uri, "r", {"rollout_id": 1, "reward_mean": 0.2})
    assert path == reports.url("metrics.jsonl") and path.startswith("memory://")
    assert reports.list_keys("") == ["metrics.jsonl"]  # no temporary object beside it
    assert [(r["rollout_id"], r["reward_mean"]) for r in read_records(uri, "r")] == [(0, 0.1), (1, 0.2)]


def test_the_configuration_is_written_and_read_back_through_the_storage():
    from vime_core.config import VimeConfig
    from vime_core.config.loader import ConfigError, dump_config, read_run_config, run_config_uri

    uri = _memory_uri()
    cfg = VimeConfig(run_name="cfg-run", storage_uri=uri, lr=3e-5, num_rollout=7)
    where = dump_config(cfg, run_config_uri(uri, cfg.run_name))
    assert where == f"{uri}/reports/cfg-run/config.json"
    assert read_run_config(uri, cfg.run_name) == cfg
    with pytest.raises(ConfigError, match="reports/other/config.json does not exist"):
        read_run_config(uri, "other")


def test_an_hf_export_on_an_object_store_is_the_folder_its_manifest_names(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file

    from vime_core.trainer.hf_export import write_hf_folder

    uri = f"{_memory_uri()}/exports/r"
    tensors = load_file(str(tiny_model_dir / "model.safetensors"))
    where = write_hf_folder(tensors.items(), tiny_model_dir, uri, label="v3")
    assert where.startswith(f"{uri}/v3-") and published_folder(open_location(uri.rsplit("/", 1)[0]), "r") == where
    local = tmp_path / "download"
    for name, data in _read_folder(where).items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    written = load_file(str(local / "model.safetensors"))
    assert written.keys() == tensors.keys() and all(torch.equal(written[k], tensors[k]) for k in tensors)
    source_files = {p.name for p in tiny_model_dir.iterdir() if p.is_file()}
    assert {p.name for p in local.iterdir()} == source_files
    assert (
        json.loads((local / "config.json").read_text())["vocab_size"]
        == json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    )
