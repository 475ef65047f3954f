"""The trainer ranks' Ray actor class (`cluster/trainer_group.TrainerActor`): the driver that creates
the group (bootstrap, `vime train`'s early start, beside the engines' start) imports neither torch
nor Megatron, and a call reaches the rank's `MegatronTrainer` under its own name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_creating_the_trainer_actor_class_imports_no_torch():
    """What run_actors does to make the actors' class, in a fresh interpreter: `ray.remote` of it
    pickles the class by reference, so the module named here is all the driver imports."""
    code = (
        "import sys, ray, cloudpickle\n"
        "from vime_core.cluster import run_actors, early_start\n"
        "from vime_core.cluster.trainer_group import TrainerActor\n"
        "ray.remote(TrainerActor); cloudpickle.dumps(TrainerActor)\n"
        "print(sorted(m for m in ('torch', 'megatron', 'vime_core.trainer.trainer') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


class _Method:
    def __init__(self, log: list) -> None:
        self.log = log

    def options(self, **options):
        self.log.append(("options", options))
        return self

    def remote(self, *args, **kwargs):
        self.log.append(("remote", args, kwargs))
        return len(self.log)


class _Handle:
    def __init__(self) -> None:
        self.log: list = []
        self.call = _Method(self.log)


def test_a_group_call_reaches_each_rank_by_the_trainers_method_name():
    from vime_core.cluster.trainer_group import TrainerGroup

    ranks = [_Handle(), _Handle()]
    TrainerGroup(cfg=None, actors=ranks).call_async("publish", ["http://e"], 3)
    for handle in ranks:
        assert handle.log == [
            ("options", {"name": "MegatronTrainer.publish"}),
            ("remote", ("publish", ["http://e"], 3), {}),
        ]


def test_the_actor_runs_the_named_method_of_its_trainer(monkeypatch):
    """`TrainerActor.call` with a stand-in for MegatronTrainer (the real one needs a model)."""
    import vime_core.trainer.trainer as trainer_module
    from vime_core.cluster.trainer_group import TrainerActor

    class Standin:
        def __init__(self, cfg, rank, world_size, master_addr, master_port, engine_token=None):
            self.made = (cfg, rank, world_size, master_addr, master_port, engine_token)

        def state(self, extra=0):
            return {"rank": self.made[1], "extra": extra}

    monkeypatch.setattr(trainer_module, "MegatronTrainer", Standin)
    actor = TrainerActor("cfg", 1, 2, "127.0.0.1", 29500, engine_token=None)
    assert actor.trainer.made == ("cfg", 1, 2, "127.0.0.1", 29500, None)
    assert actor.call("state", extra=5) == {"rank": 1, "extra": 5}
