"""The cluster layer's errors that vime_core/faults.py classifies, in a leaf module: classifying
a failure imports no actor code."""

from __future__ import annotations

from vime_core.utils.errors import InfrastructureError


class ActorsMissingError(RuntimeError, InfrastructureError):
    """The run's actors named in `missing` are not there (never created, or dead: Ray frees a
    dead actor's name)."""

    def __init__(self, message: str, missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)

    def __reduce__(self):  # crosses Ray (pickle) with its own arguments
        return type(self), (str(self), self.missing)
