"""What every Rewind task shares: the retry policy, Prefect's notifier, and catalog access."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from prefect import Task, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.events import emit_event
from prefect.exceptions import MissingContextError
from prefect.states import State
from prefect.tasks import exponential_backoff

from rewind.infra import config
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import is_transient
from rewind.infra.phases.notify import INCIDENT_KIND_LABEL, Event, artifact_key
from rewind.tasks.log_view import keep_task_state_lines_out

__all__ = [
    "INCIDENT_KIND_LABEL",
    "NO_CACHE",
    "RETRY",
    "PrefectNotifier",
    "artifact_key",
    "catalog",
    "notifier",
]


def retry_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """``retry_condition_fn`` for every Rewind task: retry what ``is_transient`` says may succeed."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:
        return is_transient(exc)
    return False


keep_task_state_lines_out()  # flow logs say what Rewind decided, not that each task finished

# Explicit, jittered backoff for transient faults only; no result caching: a phase reads the catalog
# and the tiers as they are now, so an earlier run's result is never a stand-in for running it again.
RETRY: dict[str, Any] = {
    "cache_policy": NO_CACHE,
    "retries": 3,
    "retry_delay_seconds": exponential_backoff(backoff_factor=1),
    "retry_jitter_factor": 0.5,
    "retry_condition_fn": retry_transient,
}


def catalog() -> Catalog:
    """One catalog per process and URL; the URL comes from REWIND_CATALOG_URL, read at each call."""
    return _catalog_at(config.catalog_url())


@functools.cache
def _catalog_at(url: str) -> Catalog:
    return Catalog(url)


class PrefectNotifier:
    """A phase's events as Prefect events, its tables and markdown as artifacts, its lines in the run's log."""

    def event(self, event: Event) -> None:
        emit_event(
            event=event.name,
            resource=dict(event.resource),
            related=[dict(r) for r in event.related],
            payload=dict(event.payload),
        )

    def table(self, *, key: str, rows: Sequence[Mapping[str, Any]], description: str) -> None:
        create_table_artifact(key=key, table=[dict(r) for r in rows], description=description)

    def markdown(self, *, key: str, text: str, description: str | None = None) -> None:
        create_markdown_artifact(key=key, markdown=text, description=description)

    def log(self, level: int, msg: str, *args: object) -> None:
        try:
            logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = get_run_logger()
        except MissingContextError:  # a task function called outside a run (tests, scripts)
            logger = logging.getLogger("rewind")
        logger.log(level, msg, *args)


def notifier() -> PrefectNotifier:
    return PrefectNotifier()
