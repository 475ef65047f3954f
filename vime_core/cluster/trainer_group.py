"""`TrainerGroup`: the run's trainer actors (`MegatronTrainer`, TP x DP ranks) as one handle.

A collective needs every rank, so a call goes to all ranks at once and waits for all of them;
`rank0` is for what only rank 0 answers (its state, the publish's stats). The actors are
created, found and killed by `vime_core/cluster/run_actors.py`.

Each actor is a `TrainerActor`, which builds its rank's `MegatronTrainer` in the actor's own
process: Ray pickles an actor's class by reference, so whoever creates the actor imports the
class's module, and `MegatronTrainer`'s imports torch and Megatron (seconds on a CPU box, tens
of seconds on a fresh GPU host) that the driver creating the group (bootstrap, `vime train`'s
early start, beside the engines' start) has no use for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vime_core.trainer.out_of_memory import is_out_of_memory, out_of_memory_error

if TYPE_CHECKING:
    from vime_core.config import VimeConfig


class TrainerActor:
    """One trainer rank's Ray actor: `trainer` is its `MegatronTrainer`, `call` runs one of its
    methods (named `MegatronTrainer.<method>` in Ray's task list: `submit`)."""

    def __init__(self, *args, **kwargs) -> None:
        from vime_core.trainer.trainer import MegatronTrainer  # in the actor's process only

        self.trainer = MegatronTrainer(*args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        try:
            return getattr(self.trainer, method)(*args, **kwargs)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise out_of_memory_error(method, exc) from exc
            raise


def submit(actor, method: str, *args, **kwargs):
    """`method` of the rank's trainer on a `TrainerActor`; its object reference."""
    return actor.call.options(name=f"MegatronTrainer.{method}").remote(method, *args, **kwargs)


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
        return [submit(a, method, *args, **kwargs) for a in self.actors]

    def wait(self, refs: list) -> list:
        """The results of a `call_async`, rank order."""
        import ray

        return ray.get(refs)

    def rank0(self, method: str, *args, **kwargs):
        import ray

        return ray.get(submit(self.actors[0], method, *args, **kwargs))
