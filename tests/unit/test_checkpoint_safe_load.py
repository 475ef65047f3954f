"""A trainer checkpoint's rank files load without running code (vime_core/trainer/checkpoint.py,
load_state_bytes): a file holding a pickled object that is not tensors or plain data is refused
with one line naming the file, before the object's code can run; what vime's own trainer writes
(weights, Adam state, the RNG states of torch, python and numpy, counters) still loads."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vime_core.trainer import checkpoint as ckpt


class PlantsAFile:
    """Unpickling this calls `open(path, "w").write(...)`: the attack, with a visible effect."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def _manifest(path: str) -> None:
    ckpt.write_manifest(
        path,
        {
            "rollout_id": 0,
            "world_size": 1,
            "tp": 1,
            "dp": 1,
            "weight_version": 1,
            "hf_checkpoint": "x",
            "files": ["rank_0.pt"],
            "critic_files": [],
            "critic_dir": None,
        },
    )


def _vime_like_state() -> dict:
    """What MegatronTrainer._save_state puts in a rank file, in kind."""
    weight = torch.randn(4, 3)
    return {
        "model": {"decoder.layers.0.mlp.linear_fc1.weight": weight, "decoder.layers.0.mlp._extra_state": None},
        "optimizer": {
            "state": {0: {"exp_avg": torch.zeros(4, 3), "exp_avg_sq": torch.ones(4, 3), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-6, "betas": (0.9, 0.98), "eps": 1e-8, "params": [0], "wd_mult": 1.0}],
        },
        "scheduler": {"num_steps": 3, "lr_decay_style": "constant"},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
        "weight_version": 4,
        "last_trained_rollout_id": 2,
        "optimizer_steps": 3,
        "metrics": {"reward": 0.5, "tokens": 128},
        "extra_state": {"data_source": {"epoch": 0, "offset": 64}},
    }


def test_a_checkpoint_as_vime_writes_it_loads_equal(tmp_path):
    path, state = str(tmp_path / "rollout_000000"), _vime_like_state()
    ckpt.save_rank_state(path, 0, state)
    _manifest(path)
    loaded = ckpt.load_rank_state(path, 0, 1, 1)
    assert torch.equal(
        loaded["model"]["decoder.layers.0.mlp.linear_fc1.weight"],
        state["model"]["decoder.layers.0.mlp.linear_fc1.weight"],
    )
    assert torch.equal(loaded["rng"]["torch"], state["rng"]["torch"])
    assert loaded["rng"]["python"] == state["rng"]["python"]
    assert np.array_equal(loaded["rng"]["numpy"][1], state["rng"]["numpy"][1])
    np.random.set_state(loaded["rng"]["numpy"])  # restore_rng_state's use of it
    assert loaded["extra_state"] == state["extra_state"] and loaded["optimizer_steps"] == 3


@pytest.mark.parametrize("where", ["top", "nested"])
def test_a_rank_file_with_a_code_running_pickle_is_refused_naming_it(tmp_path, where):
    marker = tmp_path / "planted"
    path = str(tmp_path / "rollout_000000")
    state = _vime_like_state()
    if where == "top":
        state["extra_state"] = PlantsAFile(str(marker))
    else:
        state["optimizer"]["param_groups"][0]["hook"] = [PlantsAFile(str(marker))]
    ckpt.save_rank_state(path, 0, state)
    _manifest(path)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.load_rank_state(path, 0, 1, 1)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}/rank_0.pt: refused to load: it holds a pickled object")
    assert not marker.exists(), "unpickling ran the planted code"


def test_the_critic_file_is_loaded_the_same_way(tmp_path):
    marker = tmp_path / "planted"
    path = str(tmp_path / "rollout_000000")
    ckpt.save_rank_state(path, 0, _vime_like_state())
    ckpt.save_rank_state(path, 0, {"model": {}, "extra": PlantsAFile(str(marker))}, critic=True)
    ckpt.write_manifest(
        path,
        {
            "rollout_id": 0,
            "world_size": 1,
            "tp": 1,
            "dp": 1,
            "weight_version": 1,
            "hf_checkpoint": "x",
            "files": ["rank_0.pt"],
            "critic_files": ["critic_rank_0.pt"],
            "critic_dir": None,
        },
    )
    with pytest.raises(ckpt.CheckpointError, match=r"critic_rank_0\.pt: refused to load"):
        ckpt.load_rank_state(path, 0, 1, 1, critic=True)
    assert not marker.exists()


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    path = str(tmp_path / "rollout_000000")
    ckpt.save_rank_state(path, 0, [torch.zeros(1)])  # type: ignore[arg-type]
    _manifest(path)
    with pytest.raises(ckpt.CheckpointError, match=r"rank_0\.pt: holds a list, not a vime rank state"):
        ckpt.load_rank_state(path, 0, 1, 1)
