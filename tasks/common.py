"""What every Rewind task shares: the retry policy, events, and catalog access."""

from __future__ import annotations

import errno
import functools
import re
from typing import Any

from prefect import Task
from prefect.client.schemas.objects import TaskRun
from prefect.events import emit_event
from prefect.states import State
from prefect.tasks import exponential_backoff

from infra import config
from infra.catalog.db import Catalog
from infra.errors import TransientError
from tasks.log_view import keep_task_state_lines_out

_TRANSIENT_ERRNOS = {
    errno.EIO,
    errno.EAGAIN,
    errno.ETIMEDOUT,
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.EBUSY,
}


def is_transient(exc: BaseException) -> bool:
    """Retry network blips, an unreachable catalog, flaky I/O; never corruption, bad input or credentials."""
    if isinstance(exc, TransientError):
        return True
    if isinstance(exc, ConnectionError | TimeoutError):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


def retry_transient(task: Task, task_run: TaskRun, state: State) -> bool:
    """``retry_condition_fn`` for every Rewind task."""
    try:
        state.result(raise_on_failure=True)
    except BaseException as exc:
        return is_transient(exc)
    return False


keep_task_state_lines_out()  # flow logs say what Rewind decided, not that each task finished

# Explicit, jittered backoff for transient faults only.
RETRY: dict[str, Any] = {
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


def run_resource(run: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"rewind.run.{run}",
        "prefect.resource.name": run,
        "prefect.resource.role": "run",
    }


def checkpoint_resource(run: str, step: int, checkpoint_id: int) -> dict[str, str]:
    return {
        "prefect.resource.id": f"rewind.checkpoint.{checkpoint_id}",
        "prefect.resource.name": f"{run}@{step}",
        "prefect.resource.role": "checkpoint",
    }


INCIDENT_KIND_LABEL = "rewind.incident.kind"  # on the run resource of rewind.failure.detected


def emit(
    event: str,
    run: str,
    payload: dict[str, Any],
    *,
    step: int | None = None,
    checkpoint_id: int | None = None,
    labels: dict[str, str] | None = None,
) -> None:
    """Emit a Rewind event about a run (primary resource, with ``labels`` added: what triggers can match)
    and, if given, one of its checkpoints."""
    related = (
        [checkpoint_resource(run, step, checkpoint_id)]
        if checkpoint_id is not None and step is not None
        else []
    )
    resource = {**run_resource(run), **(labels or {})}
    emit_event(event=event, resource=resource, related=related, payload={"run": run, **payload})


def emit_for_model(event: str, model: str, payload: dict[str, Any]) -> None:
    """Emit a Rewind serving event about a model (primary resource ``rewind.model.<name>``)."""
    resource = {
        "prefect.resource.id": f"rewind.model.{model}",
        "prefect.resource.name": model,
        "prefect.resource.role": "model",
    }
    emit_event(event=event, resource=resource, payload={"model": model, **payload})


def artifact_key(*parts: object) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")[:200]
