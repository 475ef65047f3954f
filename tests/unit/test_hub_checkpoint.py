"""``hf_checkpoint`` as a hub id: resolved from a local Hugging Face cache laid out as
huggingface_hub lays it out (models--org--name/{blobs,refs,snapshots}), offline; a clear error
naming the id and the cache when there is no snapshot. No network."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from vime_core.config import make_config
from vime_core.models.hub import HubCheckpointError, parse_hub_id, resolve_hf_checkpoint
from vime_core.run_assets import resolve_run_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_snapshot(cache: Path, repo_id: str, source: Path, commit: str = COMMIT, ref: str = "main") -> Path:
    """Put ``source``'s files in the hub cache ``cache`` as a download would: content-addressed
    blobs, the snapshot's files as symlinks to them, and refs/<ref> holding the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in sorted(p for p in source.iterdir() if p.is_file()):
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_ids_and_paths_are_told_apart():
    assert parse_hub_id("Qwen/Qwen2.5-0.5B-Instruct") == ("Qwen/Qwen2.5-0.5B-Instruct", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    assert parse_hub_id("gpt2") == ("gpt2", None)
    for not_an_id in ("a/b/c", "./model", "../model", "/abs/model", "s3://bucket/model", "org/na me"):
        assert parse_hub_id(not_an_id) is None, not_an_id


def test_hub_id_resolves_to_the_cached_snapshot_offline(hub_cache, tiny_model_dir, tmp_path):
    snapshot = cache_snapshot(hub_cache, "vime-test/tiny-qwen3", tiny_model_dir)
    assert resolve_hf_checkpoint("vime-test/tiny-qwen3", tmp_path) == str(snapshot)
    # a revision: a tag under refs/, or the commit itself
    cache_snapshot(hub_cache, "vime-test/tiny-qwen3", tiny_model_dir, commit="f" * 40, ref="v2")
    assert resolve_hf_checkpoint("vime-test/tiny-qwen3@v2", tmp_path).endswith("f" * 40)
    assert resolve_hf_checkpoint(f"vime-test/tiny-qwen3@{COMMIT}", tmp_path) == str(snapshot)


def test_hf_home_is_used_when_hf_hub_cache_is_unset(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = cache_snapshot(tmp_path / "home" / "hub", "vime-test/tiny", tiny_model_dir)
    assert resolve_hf_checkpoint("vime-test/tiny", tmp_path) == str(snapshot)


def test_run_config_carries_the_snapshot_folder(hub_cache, tiny_model_dir, tmp_path):
    snapshot = cache_snapshot(hub_cache, "vime-test/tiny-qwen3", tiny_model_dir)
    cfg = make_config(
        {
            "hf_checkpoint": "vime-test/tiny-qwen3",
            "storage_uri": str(tmp_path / "storage"),
            "prompt_data": str(tmp_path / "p.jsonl"),
        }
    )
    resolved = resolve_run_config(cfg, base=tmp_path)
    assert resolved.hf_checkpoint == str(snapshot)
    # a local folder wins over a hub id of the same spelling, and comes back absolute
    local = tmp_path / "vime-test" / "tiny-qwen3"
    shutil.copytree(tiny_model_dir, local)
    assert resolve_run_config(cfg, base=tmp_path).hf_checkpoint == str(local)


def test_uncached_hub_id_offline_names_the_id_and_the_cache(hub_cache, tmp_path):
    cfg = make_config(
        {
            "hf_checkpoint": "vime-test/absent-model@main",
            "storage_uri": str(tmp_path / "storage"),
            "prompt_data": str(tmp_path / "p.jsonl"),
        }
    )
    with pytest.raises(HubCheckpointError) as err:
        resolve_run_config(cfg, base=tmp_path)
    text = str(err.value)
    assert "hf_checkpoint" in text and "'vime-test/absent-model@main'" in text and str(hub_cache) in text
    assert "HF_HUB_OFFLINE=1" in text
    assert isinstance(err.value, FileNotFoundError)  # a configuration error: never retried (vime_core/faults.py)


def test_missing_local_path_is_not_taken_for_a_hub_id(tmp_path):
    with pytest.raises(HubCheckpointError, match="not a folder"):
        resolve_hf_checkpoint("./no/such/model", tmp_path)


def test_snapshot_without_config_json_is_refused(hub_cache, tmp_path):
    source = tmp_path / "weights-only"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"")
    cache_snapshot(hub_cache, "vime-test/no-config", source)
    with pytest.raises(HubCheckpointError, match="no config.json"):
        resolve_hf_checkpoint("vime-test/no-config", tmp_path)


def test_a_local_folder_without_config_json_is_refused_naming_the_field(tmp_path):
    """A folder that exists but is not a Hugging Face model (a Megatron checkpoint, weights alone):
    refused on the driver, naming the field, not by the trainer and every engine after their start."""
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(HubCheckpointError, match=r"^opd_teacher_load: .*weights-only holds no config.json"):
        resolve_hf_checkpoint(str(folder), tmp_path, "opd_teacher_load")


@pytest.mark.parametrize(
    "field, extra", [("ref_load", {"use_kl_loss": True}), ("critic_load", {"advantage_estimator": "ppo"})]
)
def test_a_missing_reference_or_critic_checkpoint_is_named_before_the_actors_start(
    tiny_model_dir, tmp_path, field, extra
):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    values = {
        "hf_checkpoint": str(tiny_model_dir),
        "storage_uri": str(tmp_path / "s"),
        "prompt_data": str(tmp_path / "p.jsonl"),
    }
    cfg = make_config({**values, **extra, field: str(tmp_path / "absent")})
    with pytest.raises(FileNotFoundError, match=f"^{field}: .*absent does not exist"):
        resolve_run_config(cfg, base=tmp_path)
