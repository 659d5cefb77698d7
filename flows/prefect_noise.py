"""Prefect's messages that a Rewind user cannot act on, kept out of the `rewind` command's output.

Each is named and matched exactly; anything else Prefect says still shows.

- Prefect warns at every task with a timeout that runs off the main thread ("Timeout of N seconds
  configured for this task, but the task is running in a worker thread"). The serving commands run their
  flows on a thread of their own on purpose (the main thread keeps SIGTERM; flows/cli.py), and those
  tasks' waits are bounded by Rewind's own deadlines, so the warning tells the user nothing to do.
- Prefect's events worker says "Still processing items" while it flushes events at exit.
"""

from __future__ import annotations

import logging

WORKER_THREAD_TIMEOUT = (
    "Timeout of %s seconds configured for this task, but the task is running in a worker thread"
)


STILL_PROCESSING = "Still processing items:"


class _Unactionable(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.msg if isinstance(record.msg, str) else ""
        return not (text.startswith(WORKER_THREAD_TIMEOUT) or text.startswith(STILL_PROCESSING))


_FILTER = _Unactionable()


def quiet() -> None:
    """For the `rewind` command's process; idempotent."""
    logger = logging.getLogger("prefect.task_runs")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    events = logging.getLogger("EventsWorker")  # its other warnings (a full queue dropping events) stay
    if _FILTER not in events.filters:
        events.addFilter(_FILTER)
