"""What a fault looks like: a dead actor is not retried by its task (only bootstrap rebuilds it),
and Ray's uncollected remote errors reach the console as one line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from ray.exceptions import ActorDiedError, ActorUnavailableError


def _retried(exc) -> bool:
    from tasks.common import retry_unless_configuration

    return retry_unless_configuration(None, None, SimpleNamespace(data=exc))


def test_a_task_does_not_retry_a_call_to_a_dead_actor():
    from vime_core.cluster.run_actors import ActorsMissingError
    from vime_core.faults import INFRASTRUCTURE, actor_died, classify

    dead = ActorDiedError()
    gone = ActorsMissingError("run 'r' has no trainer-0", ("trainer-0",))
    for exc in (dead, gone):
        assert actor_died(exc) and not _retried(exc)
        assert classify(exc).kind == INFRASTRUCTURE  # the iteration's retry rebuilds it
    unreachable = ActorUnavailableError("unreachable for now", None)
    assert not actor_died(unreachable) and _retried(unreachable)
    assert _retried(ConnectionResetError("reset"))


def test_an_uncollected_ray_error_is_one_line_on_the_console():
    from flows.train import RAY_DRIVER_LOGGER, one_line_failures

    remote = ("Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): ray::RolloutManager.end_sync() (pid=1)\n"
              "  At least one of the input arguments for this task could not be computed:\n"
              '  File "/x/vime_core/engines/client.py", line 176, in request\n'
              "    raise EngineError(...)\n"
              "vime_core.engines.client.EngineError: engine engine-0: GET /weight_info failed (no answer)\n")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    logger = logging.getLogger(RAY_DRIVER_LOGGER)
    handler = Keep()
    logger.addHandler(handler)
    try:
        with one_line_failures():
            logger.error(remote)
        logger.error(remote)  # outside the run: untouched
    finally:
        logger.removeHandler(handler)
    assert seen[0] == ("Unhandled error (suppress with 'RAY_IGNORE_UNHANDLED_ERRORS=1'): "
                       "vime_core.engines.client.EngineError: engine engine-0: GET /weight_info failed (no answer)")
    assert seen[1] == remote
