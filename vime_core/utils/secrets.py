"""Keeping credentials out of stored configurations, metadata, logs and error messages. Applied
recursively, these become REDACTED: a value under a key naming a credential (not `*_env`, `*_file`,
`*_path` or `tokens`-style data keys), a URI's password and credential-named query parameters, the
value after a credential-named flag or in a NAME=VALUE word, and this process's AWS credential
values anywhere. Redacting twice gives the same text as once, so config_hash is stable."""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

REDACTED = "<redacted>"

_CREDENTIAL_WORDS = (
    r"secret|passw(or)?d|access[_-]?key|session[_-]?token|auth[_-]?token|api[_-]?key|credential|"
    r"private[_-]?key|signature|bearer|^token$|[_-]token$|^key$"
)
_CREDENTIAL_KEY = re.compile(f"({_CREDENTIAL_WORDS})", re.IGNORECASE)
# Where a credential is kept is not a credential: rm_api_key_env, rm_api_key_file, ..._path.
_LOCATION_KEY = re.compile(r"(_env|_file|_path|_dir)$", re.IGNORECASE)
# user:password@ (the password may hold "/", as AWS secret keys do), and a token alone before "@"
_URI_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/:@\s]+:)[^@\s]+(?P<tail>@)")
_URI_TOKEN = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/:@\s]+(?P<tail>@)")
_QUERY_CREDENTIAL = re.compile(
    r"(?P<head>[?&;](?P<name>[^=&#\s\"']*(key|token|secret|signature|sig|passw|pwd|auth|credential|code|jwt|cookie|"
    r"session)[^=&#\s\"']*)=)" + "(?!" + re.escape(REDACTED) + r")[^&#\s\"']*",
    re.IGNORECASE,
)
_CREDENTIAL_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ACCESS_KEY_ID")


def credential_values() -> list[str]:
    """The credential values set in this process's environment (long enough to be one)."""
    return [v for v in (os.environ.get(name, "") for name in _CREDENTIAL_ENV) if len(v) >= 8]


def is_credential_name(name: str) -> bool:
    """Whether a key, flag or variable name names a credential (module docstring)."""
    bare = name.lstrip("-")
    return bool(_CREDENTIAL_KEY.search(bare)) and not _LOCATION_KEY.search(bare)


def redact_text(text: str, secrets: list[str] | None = None) -> str:
    """`text` with the environment's credential values, URI passwords and credential-named query
    parameters' values replaced by REDACTED."""
    for value in credential_values() if secrets is None else secrets:
        text = text.replace(value, REDACTED)
    text = _URI_PASSWORD.sub(lambda m: m.group("head") + REDACTED + m.group("tail"), text)
    text = _URI_TOKEN.sub(lambda m: m.group("head") + REDACTED + m.group("tail"), text)
    return _QUERY_CREDENTIAL.sub(lambda m: m.group("head") + REDACTED, text)


def _redact_words(words: list[Any] | tuple[Any, ...], secrets: list[str]) -> list[Any]:
    """A list with the values of credential-named flags (`--api-key V`, `--api-key=V`) and
    `NAME=VALUE` words redacted, then every item by redact_secrets."""
    out: list[Any] = []
    hide_next = False
    for word in words:
        if hide_next and isinstance(word, str):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if isinstance(word, str):
            name, sep, value = word.partition("=")
            if sep and value and " " not in name and is_credential_name(name):
                out.append(f"{name}={REDACTED}")
                continue
            if word.startswith("-") and not sep and is_credential_name(word):
                hide_next = True
        out.append(redact_secrets(word, secrets))
    return out


def redact_secrets(obj: Any, secrets: list[str] | None = None) -> Any:
    """A copy of `obj` with credentials replaced by REDACTED (see module docstring)."""
    secrets = credential_values() if secrets is None else secrets
    if isinstance(obj, dict):
        return {
            k: (
                REDACTED
                if isinstance(k, str)
                and is_credential_name(k)
                and v not in (None, "", REDACTED)
                and not isinstance(v, (bool, int, float))
                else redact_secrets(v, secrets)
            )
            for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return _redact_words(obj, secrets)
    if isinstance(obj, str):
        return redact_text(obj, secrets)
    return obj


def _userinfo(url: str) -> tuple[str, str]:
    """(the userinfo of `url`, `url` without it). The userinfo is what comes between "://" and the
    first "@" before any "?" or "#", when the user name before its first ":" (or the whole of it,
    with no ":") holds no "/": a password may hold "/" (AWS secret keys do), where urlsplit would
    end the host at the first "/" and take the rest for a path; `s3://bucket/key@v1` has none."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "", url
    before_query = re.split(r"[?#]", rest, maxsplit=1)[0]
    info, at, _ = before_query.partition("@")
    if not at or "/" in info.partition(":")[0]:
        return "", url
    return info, f"{scheme}://{rest[len(info) + 1 :]}"


def carries_userinfo(url: str) -> bool:
    """Whether `url` has credentials in its host part (scheme://user:secret@host/..., or a token
    alone before the "@")."""
    return bool(_userinfo(url)[0])


def redact_url(url: str) -> str:
    """A URL to show in logs and errors: scheme, host, port and path; no user:password, query or
    fragment (a token may ride in a query string), no trailing slash."""
    parts = urlsplit(_userinfo(url)[1])
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", "")).rstrip("/")
