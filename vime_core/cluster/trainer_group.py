"""`TrainerGroup`: the run's trainer actors (`MegatronTrainer`, TP x DP ranks) as one handle.

A collective needs every rank, so a call goes to all ranks at once and waits for all of them;
`rank0` is for what only rank 0 answers (its state, the publish's stats). The actors are
created, found and killed by `vime_core/cluster/run_actors.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vime_core.config import VimeConfig


@dataclass
class TrainerGroup:
    """Handles of the run's trainer actors, rank order."""

    cfg: "VimeConfig"
    actors: list[Any]

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every rank concurrently (collectives need all ranks) and wait."""
        return self.wait(self.call_async(method, *args, **kwargs))

    def call_async(self, method: str, *args, **kwargs) -> list:
        """Submit `method` on every rank; the object references, rank order. An ObjectRef among
        the arguments is resolved by Ray before the call runs: the call waits for it in the
        actor's queue, not in the driver."""
        return [getattr(a, method).remote(*args, **kwargs) for a in self.actors]

    def wait(self, refs: list) -> list:
        """The results of a `call_async`, rank order."""
        import ray

        return ray.get(refs)

    def rank0(self, method: str, *args, **kwargs):
        import ray

        return ray.get(getattr(self.actors[0], method).remote(*args, **kwargs))
