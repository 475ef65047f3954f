"""Where an `s3://` store's server is, resolved once when a configuration is made (and by library
callers without one), never its credentials (botocore's chain reads those):

    endpoint  the value given, else AWS_ENDPOINT_URL_S3, else AWS_ENDPOINT_URL, else "" (AWS itself)
    region    the value given, else AWS_REGION, else AWS_DEFAULT_REGION, else "" (botocore's choice)

and how often a request to it is retried (configuration only; unset: botocore's own count).

An endpoint carrying credentials is refused: it is recorded in dumps, lineage and logs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from vime_core.utils.secrets import carries_userinfo

ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
REGION_ENV = ("AWS_REGION", "AWS_DEFAULT_REGION")


class EndpointCredentialsError(Exception):
    """An endpoint URL carrying credentials. Not a ValueError on purpose: pydantic would turn
    that into a validation error that repeats the input (the credentials) in its message."""


@dataclass(frozen=True)
class S3Endpoint:
    url: str = ""  # "": AWS itself
    region: str = ""  # "": botocore's own choice
    request_retries: int | None = None  # retries of each request (botocore's max_attempts); None: botocore's own

    @classmethod
    def of(cls, cfg) -> "S3Endpoint":
        """The configuration's (already resolved when it was made)."""
        return cls(cfg.storage_endpoint_url, cfg.storage_region, cfg.storage_request_retries)


def _first(names: tuple[str, ...], environ: Mapping[str, str]) -> str:
    return next((environ[n] for n in names if environ.get(n)), "")


def resolve_endpoint_url(
    url: str = "", environ: Mapping[str, str] = os.environ, field: str = "storage_endpoint_url"
) -> str:
    """`url`, else the environment's (module docstring); refuses one carrying credentials."""
    value = url or _first(ENDPOINT_ENV, environ)
    if carries_userinfo(value):
        source = field if url else "/".join(ENDPOINT_ENV)
        raise EndpointCredentialsError(
            f"{source}: the S3 endpoint carries credentials in its host part (scheme://user:secret@...): "
            "refused; put them in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile"
        )
    return value


def resolve_region(region: str = "", environ: Mapping[str, str] = os.environ) -> str:
    return region or _first(REGION_ENV, environ)


def resolve(url: str = "", region: str = "", environ: Mapping[str, str] = os.environ) -> S3Endpoint:
    return S3Endpoint(resolve_endpoint_url(url, environ), resolve_region(region, environ))
