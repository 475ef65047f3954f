"""A RolloutManager created anew (a resumed run, a dead manager) continues the data source from
the position recorded with the newest stored batch, not from the checkpoint's: the batches
stored since the checkpoint are loaded from the store instead of being generated, so starting
from the checkpoint's position would give the next fresh rollout the prompts of a stored one
(seen in a real run: rollout 5 of a resumed run got rollout 3's prompts)."""

from __future__ import annotations

import pytest

from vime_core.config import VimeConfig
from vime_core.demo.settings import demo_config
from vime_core.storage import BatchStore
from vime_core.storage.synthetic import synthetic_batch


def _store(tmp_path, positions: dict[int, dict | None]) -> VimeConfig:
    from vime_core.cluster.batch_io import lineage_for

    cfg = demo_config(run_name="resume", storage_uri=str(tmp_path), hf_checkpoint="x")
    for rollout_id, state in positions.items():
        BatchStore(cfg.storage_uri).write(synthetic_batch(seed=rollout_id), lineage_for(cfg, rollout_id, "f", state))
    return cfg


def test_the_newest_stored_batch_says_where_the_data_source_stands(tmp_path):
    from vime_core.cluster.batch_io import data_source_after

    cfg = _store(tmp_path, {0: {"epoch": 0, "offset": 4}, 1: {"epoch": 0, "offset": 8}, 2: None})
    assert data_source_after(cfg, 0) == (1, {"epoch": 0, "offset": 8})  # 2 recorded none (an older batch)
    assert data_source_after(cfg, 2) is None


class _Manager:
    def __init__(self):
        self.loaded, self.discarded = [], []
        self.load_data_source_state = type("M", (), {"remote": lambda _, s: self.loaded.append(s)})()
        self.discard_prefetch = type("M", (), {"remote": lambda _, r: self.discarded.append(r)})()


@pytest.fixture
def bootstrap_module(monkeypatch):
    import logging

    import tasks.bootstrap as bootstrap

    monkeypatch.setattr(bootstrap.ray, "get", lambda x: x)
    monkeypatch.setattr(bootstrap, "get_run_logger", lambda: logging.getLogger("test"))
    return bootstrap


def test_a_new_manager_takes_the_stored_position_else_the_checkpoints(tmp_path, bootstrap_module):
    cfg = _store(tmp_path, {3: {"epoch": 1, "offset": 12}})
    manager = _Manager()
    bootstrap_module._restore_data_source(cfg, manager, {"epoch": 1, "offset": 4}, new_manager=True)
    assert manager.loaded == [{"epoch": 1, "offset": 12}]

    empty = demo_config(run_name="fresh", storage_uri=str(tmp_path / "none"), hf_checkpoint="x")
    manager = _Manager()
    bootstrap_module._restore_data_source(empty, manager, {"epoch": 1, "offset": 4}, new_manager=True)
    assert manager.loaded == [{"epoch": 1, "offset": 4}]


def test_a_manager_that_lived_on_keeps_its_position_and_drops_its_prefetch(tmp_path, bootstrap_module):
    cfg = _store(tmp_path, {3: {"epoch": 1, "offset": 12}})
    manager = _Manager()
    bootstrap_module._restore_data_source(cfg, manager, {"epoch": 1, "offset": 4}, new_manager=False)
    assert manager.loaded == [] and manager.discarded == [True]
