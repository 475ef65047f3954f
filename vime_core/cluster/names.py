"""Names of a run's Ray objects. Everything a run owns lives in the namespace `vime-<run>`, so a
new flow run (a new Ray driver) finds the same actors with `ray.get_actor(name, namespace)`."""

from __future__ import annotations


def namespace(run_name: str) -> str:
    return f"vime-{run_name}"


ROLLOUT_MANAGER = "rollout-manager"
PLACEMENT_GROUP = "devices"


def trainer(rank: int) -> str:
    return f"trainer-{rank}"


def engine(index: int) -> str:
    return f"engine-{index}"


def placement_group(run_name: str) -> str:
    return f"vime-{run_name}-{PLACEMENT_GROUP}"
