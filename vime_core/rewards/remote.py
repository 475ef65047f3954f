"""A reward model behind HTTP (rm_type=remote_rm): one POST per sample with {"prompt", "response",
"label", "metadata"}, answered by a JSON number or {"reward": number} (values.as_reward). Transport
errors, timeouts, 429 and 5xx are retried with back-off (utils/retry.py). Headers are never logged
and URLs are shown without user-info or query string."""

from __future__ import annotations

import logging
from typing import Any, Optional

import httpx

from vime_core.rewards.values import InvalidRewardError, as_reward
from vime_core.utils.retry import RetryCallState, async_attempts
from vime_core.utils.secrets import redact_url

log = logging.getLogger(__name__)

RETRYABLE_STATUS = {408, 425, 429, 500, 502, 503, 504}


class RemoteRewardError(RuntimeError):
    """The reward model did not give a usable reward; the message holds no headers or secrets."""


class _NoAnswer(Exception):
    """An attempt worth repeating (transport error, timeout, RETRYABLE_STATUS); the text says
    which, and holds no headers."""


def parse_reward(payload: Any, shown: str = "") -> float:
    """The reward in an answer, a JSON number or {"reward": number}, by the hub's rule (a bool is
    0/1; NaN and Infinity are refused: values.as_reward). The error names the answer's type only:
    a reward model's answer may quote private text."""
    value = payload.get("reward") if isinstance(payload, dict) else payload
    try:
        return as_reward(value)
    except InvalidRewardError as exc:
        what = exc.what.removeprefix("returned ")
        answer = f"{{'reward': {what}}}" if isinstance(payload, dict) else what
        raise RemoteRewardError(
            f"reward model {shown or 'at rm_url'} answered {answer}; expected a finite number or {{'reward': number}}"
        ) from None


class RemoteRewardModel:
    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        headers: Optional[dict[str, str]] = None,
    ) -> None:
        if not url:
            raise ValueError("rm_url is empty; rm_type=remote_rm needs the reward model's URL")
        self.url = url
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._headers = dict(headers or {})

    def __repr__(self) -> str:  # never show headers
        url = redact_url(self.url)
        return f"RemoteRewardModel(url={url!r}, timeout_s={self.timeout_s}, max_retries={self.max_retries})"

    async def __call__(self, sample) -> float:
        body = {
            "prompt": sample.prompt,
            "response": sample.response,
            "label": sample.label,
            "metadata": sample.metadata,
        }
        shown = redact_url(self.url)

        async def once(client: httpx.AsyncClient) -> float:
            try:
                response = await client.post(self.url, json=body)
            except httpx.TimeoutException:
                raise _NoAnswer(f"timed out after {self.timeout_s}s") from None
            except httpx.TransportError as exc:
                raise _NoAnswer(type(exc).__name__) from None
            if response.status_code in RETRYABLE_STATUS:
                raise _NoAnswer(f"HTTP {response.status_code}")
            if response.status_code >= 400:
                raise RemoteRewardError(
                    f"reward model {shown} answered HTTP {response.status_code}: {response.text[:200]!r}"
                )
            try:
                payload = response.json()
            except ValueError:
                raise RemoteRewardError(f"reward model {shown} answered non-JSON: {response.text[:200]!r}") from None
            return parse_reward(payload, shown)

        def log_retry(state: RetryCallState) -> None:
            log.warning(
                "reward model %s: %s; retry %d/%d in %.2fs",
                shown,
                state.outcome.exception(),
                state.attempt_number,
                self.max_retries,
                state.upcoming_sleep,
            )

        retrying = async_attempts(
            self.max_retries + 1, self.backoff_s, retry_on=lambda exc: isinstance(exc, _NoAnswer), on_retry=log_retry
        )
        async with httpx.AsyncClient(timeout=self.timeout_s, headers=self._headers) as client:
            try:
                return await retrying(once, client)
            except _NoAnswer as exc:
                raise RemoteRewardError(
                    f"reward model {shown} failed after {self.max_retries + 1} attempts: {exc}"
                ) from None
