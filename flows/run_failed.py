"""A flow run that ends Failed on purpose: the job crashed, a relaunch failed again.

Its state carries what the run found (``summary`` reads it back, ended well or not) inside a
``RunFailed``, an exception, because Prefect's engine turns a failed state's data into the exception it
raises when the run ends: a dict there was a ``TypeError`` and a traceback in every served run's log. The
failure is already told in full by the state's message; Prefect's "Engine execution exited with unexpected
exception" traceback for it is left out of the flow-run log (``quiet_expected_failures``), and only for it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from prefect.states import Failed, State

ENGINE_EXIT = "Engine execution exited with unexpected exception"


class RunFailed(Exception):
    """The failure a run reported itself, with what it found."""

    def __init__(self, message: str, summary: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.summary = dict(summary or {})

    def __reduce__(self) -> tuple[Any, ...]:
        return (RunFailed, (str(self), self.summary))


def failed(message: str, summary: Mapping[str, Any]) -> State:
    return Failed(message=message, data=RunFailed(message, summary))


def summary(state: State) -> dict[str, Any]:
    """What a protect-training, recover-training or restore-checkpoint run returned, ended well or not
    (call the flow with ``return_state=True``); a run that failed by raising raises that here."""
    got = state.result(raise_on_failure=False)
    if isinstance(got, RunFailed):
        return dict(got.summary)
    if isinstance(got, BaseException):
        raise got
    return dict(got)


class _ExpectedFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (record.msg == ENGINE_EXIT and isinstance(exc, RunFailed))


_FILTER = _ExpectedFailure()


def quiet_expected_failures() -> None:
    """Installed when the flows are imported (in every flow-run process); idempotent."""
    logger = logging.getLogger("prefect.flow_runs")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
