"""Where a checkpoint's critic files go and where a resume reads them (critic_save,
vime_core/trainer/checkpoint.py): beside the policy's rank files by default; under
`<critic_save>/<run>/rollout_<k:06d>/` with it, the folder named by the checkpoint's manifest,
which is what a reader follows (a manifest without critic_dir: the checkpoint's own folder)."""

from __future__ import annotations

import re
import uuid

import pytest
import torch

from vime_core.config import load_config
from vime_core.trainer import checkpoint as ckpt


def _cfg(tmp_path, **over):
    return load_config(
        overrides={"advantage_estimator": "ppo", "run_name": "r1", "storage_uri": str(tmp_path / "store"), **over}
    )


def test_without_critic_save_the_critic_files_sit_in_the_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    assert (
        ckpt.checkpoint_dir(cfg, 7)
        == ckpt.checkpoint_dir(cfg, 7, critic=True)
        == f"{tmp_path}/store/checkpoints/r1/rollout_000007"
    )


@pytest.mark.parametrize(
    "critic_save, root",
    [
        ("s3://bucket/critics/", "s3://bucket/critics/r1"),
        ("critics", "{tmp}/critics/r1"),  # relative: made absolute when the configuration is made
    ],
)
def test_critic_save_keys_the_critic_files_by_run_and_rollout(tmp_path, monkeypatch, critic_save, root):
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path, critic_save=critic_save)
    assert ckpt.checkpoint_dir(cfg, 12, critic=True) == root.format(tmp=tmp_path) + "/rollout_000012"
    assert ckpt.checkpoint_dir(cfg, 12) == f"{tmp_path}/store/checkpoints/r1/rollout_000012"  # the policy's stays
    assert ckpt.checkpoint_root(cfg) == f"{tmp_path}/store/checkpoints/r1"  # where latest_checkpoint looks


def _write(path: str, critic_path: str, rank_state: dict, critic_state: dict) -> None:
    """A one-rank checkpoint written in the trainer's order (MegatronTrainer._save_state)."""
    ckpt.save_rank_state(path, 0, rank_state)
    ckpt.save_rank_state(critic_path, 0, critic_state, critic=True)
    ckpt.write_manifest(
        path,
        {
            "rollout_id": 3,
            "world_size": 1,
            "tp": 1,
            "dp": 1,
            "weight_version": 4,
            "hf_checkpoint": "x",
            "files": ["rank_0.pt"],
            "critic_files": ["critic_rank_0.pt"],
            "critic_dir": critic_path if critic_path != path else None,
        },
    )


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_reader_follows_the_manifest_to_the_critic_folder(tmp_path, where):
    critics = str(tmp_path / "critics") if where == "local" else f"memory://vime-test-{uuid.uuid4().hex}/critics"
    cfg = _cfg(tmp_path, critic_save=critics)
    path, critic_path = ckpt.checkpoint_dir(cfg, 3), ckpt.checkpoint_dir(cfg, 3, critic=True)
    critic_state = {"model": {"value_head.weight": torch.arange(4.0)}, "scheduler": {"num_steps": 5}}
    _write(path, critic_path, {"model": {"w": torch.ones(2)}}, critic_state)

    manifest = ckpt.read_manifest(path)
    assert manifest["critic_dir"] == critic_path and ckpt.critic_dir(path, manifest) == critic_path
    loaded = ckpt.load_rank_state(path, 0, 1, 1, critic=True)
    assert torch.equal(loaded["model"]["value_head.weight"], critic_state["model"]["value_head.weight"])
    assert loaded["scheduler"] == {"num_steps": 5}
    assert torch.equal(ckpt.load_rank_state(path, 0, 1, 1)["model"]["w"], torch.ones(2))
    assert not (tmp_path / "store/checkpoints/r1/rollout_000003/critic_rank_0.pt").exists()  # not beside the policy's
    assert ckpt.latest_checkpoint(cfg) == path


def test_a_manifest_without_critic_dir_reads_the_critic_beside_it(tmp_path):
    """A checkpoint written without critic_save, or before it existed: its manifest has no
    critic_dir (or null), and a run resuming with critic_save set still finds its critic."""
    cfg = _cfg(tmp_path)
    path = ckpt.checkpoint_dir(cfg, 3)
    _write(path, path, {"model": {}}, {"model": {"b": torch.zeros(1)}})
    manifest = ckpt.read_manifest(path)
    assert manifest["critic_dir"] is None and ckpt.critic_dir(path, manifest) == path
    assert ckpt.critic_dir(path, {k: v for k, v in manifest.items() if k != "critic_dir"}) == path
    assert torch.equal(ckpt.load_rank_state(path, 0, 1, 1, critic=True)["model"]["b"], torch.zeros(1))


def test_a_critic_file_missing_from_its_folder_is_named(tmp_path):
    cfg = _cfg(tmp_path, critic_save=str(tmp_path / "critics"))
    path, critic_path = ckpt.checkpoint_dir(cfg, 3), ckpt.checkpoint_dir(cfg, 3, critic=True)
    _write(path, critic_path, {"model": {}}, {"model": {}})
    (tmp_path / "critics/r1/rollout_000003/critic_rank_0.pt").unlink()
    with pytest.raises(
        ckpt.CheckpointError,
        match="^" + re.escape(f"{critic_path}: critic_rank_0.pt is missing although {path}/manifest.json lists it"),
    ):
        ckpt.load_rank_state(path, 0, 1, 1, critic=True)


def test_critic_files_without_a_manifest_are_no_checkpoint(tmp_path):
    """A save cut short after the critic's file, before the manifest: nothing to resume from."""
    cfg = _cfg(tmp_path, critic_save=str(tmp_path / "critics"))
    ckpt.save_rank_state(ckpt.checkpoint_dir(cfg, 0), 0, {"model": {}})
    ckpt.save_rank_state(ckpt.checkpoint_dir(cfg, 0, critic=True), 0, {"model": {}}, critic=True)
    assert ckpt.latest_checkpoint(cfg) is None


def test_the_latest_checkpoint_is_the_highest_rollout_id_and_copies_are_not_checkpoints(tmp_path):
    """Folders ordered by their rollout id as a number (rollout_1000000 after rollout_999999, past
    the six digits of the name), and a copy such as rollout_000010.bak, manifest and all, is no
    checkpoint of the run."""
    cfg = _cfg(tmp_path)
    root = tmp_path / "store/checkpoints/r1"
    for name in ("rollout_999998", "rollout_999999", "rollout_1000000", "rollout_000010.bak"):
        (root / name).mkdir(parents=True)
        (root / name / ckpt.MANIFEST).write_text("{}")
    assert [k for k, _ in ckpt.finished_checkpoints(cfg)] == [999998, 999999, 1000000]
    assert ckpt.latest_checkpoint(cfg) == f"{root}/rollout_1000000" == ckpt.checkpoint_dir(cfg, 1000000)
