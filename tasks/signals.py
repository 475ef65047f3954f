"""Whether a failure is the process being told to stop: Prefect's side of vime_core/faults.py.

vime_core never imports Prefect, so the stop signals that include Prefect's own live here, beside
the tasks whose retry condition (tasks/common.py) asks.
"""

from __future__ import annotations

from prefect.exceptions import ExternalSignal

from vime_core.faults import raised_in_chain

# Ctrl-C (or SIGTERM under `vime train`: vime_core.utils.interrupt), sys.exit, and Prefect's
# TerminationSignal (an ExternalSignal).
STOP_SIGNALS: tuple[type[BaseException], ...] = (KeyboardInterrupt, SystemExit, ExternalSignal)


def stopped_by_signal(exc: BaseException) -> bool:
    """`exc` is, or came from, the process being told to stop (STOP_SIGNALS). Raised inside a C
    call, such a signal arrives wrapped in a SystemError; retrying it would go on with work the
    user or the scheduler just stopped."""
    return raised_in_chain(exc, STOP_SIGNALS)
