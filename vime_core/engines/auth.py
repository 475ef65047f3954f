"""The run's engine token, on the side that sends it: one per run, made at start, handed to the run's
actors through Ray (never a file), sent as `Authorization: Bearer <token>` (docs/gpus-and-clusters.md).
`EngineToken` hides its value from repr, str and f-strings; `reveal()` is called only where the header
or the engine's environment is built. Servers vime does not start get the driver's VIME_ENGINE_TOKEN."""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Mapping, Optional

from vime_core.engines.vllm_side.auth import OPEN_HEALTH_ENV, TOKEN_ENV

MIDDLEWARE = "vime_core.engines.vllm_side.auth.EngineAuthMiddleware"
TOKEN_BYTES = 32  # 256 random bits: not guessable over HTTP
__all__ = ["EngineToken", "MIDDLEWARE", "OPEN_HEALTH_ENV", "TOKEN_ENV", "auth_headers"]


class EngineToken:
    """A bearer token whose value shows only through `reveal()`."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        # printable ASCII without spaces: the only characters an HTTP header value carries intact
        if not value or not all(33 <= ord(c) <= 126 for c in value):
            raise ValueError(f"an engine token must be non-empty printable ASCII without spaces (${TOKEN_ENV}?)")
        self._value = value

    @classmethod
    def new(cls) -> "EngineToken":
        return cls(secrets.token_urlsafe(TOKEN_BYTES))

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["EngineToken"]:
        """The user's token for servers vime does not start: `VIME_ENGINE_TOKEN`, or None."""
        value = (os.environ if environ is None else environ).get(TOKEN_ENV, "")
        return cls(value) if value else None

    def reveal(self) -> str:
        return self._value

    def header_value(self) -> str:
        return f"Bearer {self._value}"

    def __repr__(self) -> str:
        return "EngineToken(<redacted>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EngineToken) and hmac.compare_digest(self._value, other._value)

    def __hash__(self) -> int:
        return hash((EngineToken, self._value))

    def __reduce__(self):  # crosses Ray (pickle) as itself; never as text
        return EngineToken, (self._value,)


def auth_headers(token: Optional[EngineToken]) -> dict[str, str]:
    """`{"Authorization": "Bearer <token>"}`, or nothing without a token."""
    return {"Authorization": token.header_value()} if token is not None else {}
