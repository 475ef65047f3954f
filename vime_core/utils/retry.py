"""The retry and poll policies of vime, on tenacity, so each caller states only what differs. The wait
after failed attempt n (n = 1, 2, ...; none after the last):

    wait(n) = min(first_s * 2^(n-1), max_s)

A tenacity object keeps per-run state on itself, so each call builds a new one."""

from __future__ import annotations

import math
from typing import Callable, Optional

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_result,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
    wait_fixed,
)

__all__ = ["RetryCallState", "async_attempts", "attempts", "backoff", "poll_until"]


def backoff(first_s: float, max_s: float = math.inf) -> wait_exponential:
    """wait(n) = min(first_s * 2^(n-1), max_s) after failed attempt n (module docstring)."""
    return wait_exponential(multiplier=first_s, max=max_s)


def _policy(
    max_attempts: int,
    first_s: float,
    max_s: float,
    retry_on: Callable[[BaseException], bool],
    on_retry: Optional[Callable[[RetryCallState], None]],
) -> dict:
    if max_attempts < 1:
        raise ValueError(f"max_attempts={max_attempts} must be at least 1")
    return dict(
        stop=stop_after_attempt(max_attempts),
        wait=backoff(first_s, max_s),
        retry=retry_if_exception(retry_on),
        before_sleep=on_retry,
        reraise=True,
    )


def async_attempts(
    max_attempts: int,
    first_s: float,
    max_s: float = math.inf,
    retry_on: Callable[[BaseException], bool] = lambda exc: True,
    on_retry: Optional[Callable[[RetryCallState], None]] = None,
) -> AsyncRetrying:
    """Up to `max_attempts` attempts of an async call, `backoff(first_s, max_s)` between them.

    An exception for which `retry_on(exc)` is false propagates at once; after the last attempt
    the last exception propagates as it was raised (callers turn it into their own error).
    `on_retry(state)` runs before each wait (`state.attempt_number`, `state.outcome.exception()`,
    `state.upcoming_sleep`). Use as `await async_attempts(...)(fn, *args)` or
    `async for attempt in async_attempts(...): with attempt: ...`.
    """
    return AsyncRetrying(**_policy(max_attempts, first_s, max_s, retry_on, on_retry))


def attempts(
    max_attempts: int,
    first_s: float = 0.0,
    max_s: float = math.inf,
    retry_on: Callable[[BaseException], bool] = lambda exc: True,
    on_retry: Optional[Callable[[RetryCallState], None]] = None,
) -> Retrying:
    """The blocking twin of `async_attempts` (same arguments, same behaviour)."""
    return Retrying(**_policy(max_attempts, first_s, max_s, retry_on, on_retry))


def poll_until(ready: Callable[[], bool], timeout_s: float, interval_s: float) -> bool:
    """Call `ready()` every `interval_s` seconds until it returns true (-> True) or `timeout_s`
    seconds have passed since the first call (-> False; `ready` is not called again after that).

    An exception raised by `ready` ends the poll at once and propagates: that is how a caller
    stops waiting for something that can no longer become ready (the process exited)."""
    return bool(
        Retrying(
            stop=stop_after_delay(timeout_s),
            wait=wait_fixed(interval_s),
            retry=retry_if_result(lambda ok: not ok),
            retry_error_callback=lambda state: False,
        )(ready)
    )
