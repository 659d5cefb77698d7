"""Flow-run logs that say what Rewind decided, not that each task finished.

Prefect logs one ``Finished in state Completed()`` line per task run on the same
logger (``prefect.task_runs``) that tasks use for their own lines, so a level cannot
tell them apart; a filter on that logger drops the completed-task lines (failures are
logged at ERROR and kept, and so is every domain line). ``REWIND_TASK_STATE_LOGS=1``
keeps them all. Installed when ``rewind.tasks.common`` is imported, which every flow module does, in the
flow-run process, after Prefect has set its logging up.
"""

from __future__ import annotations

import logging
import os

TASK_LOGGER = "prefect.task_runs"


class CompletedTaskLines(logging.Filter):
    """Drop Prefect's per-task 'Finished in state Completed()' lines; let everything else through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.INFO:
            return True
        return not str(record.msg).startswith("Finished in state Completed")


def keep_task_state_lines_out() -> None:
    if os.environ.get("REWIND_TASK_STATE_LOGS"):
        return
    logger = logging.getLogger(TASK_LOGGER)
    if not any(isinstance(f, CompletedTaskLines) for f in logger.filters):
        logger.addFilter(CompletedTaskLines())
