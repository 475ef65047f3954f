"""Keeping credentials out of stored metadata, logs and error messages.

Three rules, applied recursively to dicts, lists and strings:
- a value under a key that names a credential (secret, password, token, access key, ...) becomes
  `REDACTED` (`tokens`-style data keys such as `max_tokens_per_gpu` are not credentials);
- the password part of a URI (`scheme://user:password@host`) becomes `REDACTED`;
- any occurrence of the current process's AWS credential values (from the environment) becomes
  `REDACTED`, wherever it appears.
"""

from __future__ import annotations

import os
import re
from typing import Any

REDACTED = "<redacted>"

_CREDENTIAL_KEY = re.compile(
    r"(secret|passw(or)?d|access[_-]?key|session[_-]?token|auth[_-]?token|api[_-]?key|credential|private[_-]?key|^token$)",
    re.IGNORECASE,
)
_URI_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/:@\s]+:)[^/@\s]+(?P<tail>@)")
_CREDENTIAL_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")


def credential_values() -> list[str]:
    """The credential values set in this process's environment (long enough to be one)."""
    return [v for v in (os.environ.get(name, "") for name in _CREDENTIAL_ENV) if len(v) >= 8]


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    for value in credential_values() if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    return _URI_PASSWORD.sub(lambda m: m.group("head") + REDACTED + m.group("tail"), text)


def redact_secrets(obj: Any, secrets: list[str] | None = None) -> Any:
    """A copy of `obj` with credentials replaced by REDACTED (see module docstring)."""
    secrets = credential_values() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            k: (REDACTED if isinstance(k, str) and _CREDENTIAL_KEY.search(k) and v not in (None, "")
                else redact_secrets(v, secrets))
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [redact_secrets(v, secrets) for v in obj]
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    return obj
