"""What a phase tells the world, and the small interface it is told through.

Events name a run (``rewind.run.<name>``: what triggers match) and, where there is one, a
checkpoint as a related resource; artifacts are tables and markdown a person reads. A
``Notifier`` delivers them: Prefect's events and artifacts inside a flow, log lines in the CLI.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

INCIDENT_KIND_LABEL = "rewind.incident.kind"  # on the run resource of rewind.failure.detected

log = logging.getLogger("rewind.events")


@dataclass(frozen=True, slots=True)
class Event:
    """One Rewind event: its name, the resource it is about, related resources, its payload."""

    name: str
    resource: Mapping[str, str]
    payload: Mapping[str, Any]
    related: tuple[Mapping[str, str], ...] = field(default=())


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


def run_event(
    name: str,
    run: str,
    payload: Mapping[str, Any],
    *,
    step: int | None = None,
    checkpoint_id: int | None = None,
    labels: Mapping[str, str] | None = None,
) -> Event:
    """An event about a run (with ``labels`` added to its resource) and, if given, one of its checkpoints."""
    related = (
        (checkpoint_resource(run, step, checkpoint_id),)
        if checkpoint_id is not None and step is not None
        else ()
    )
    resource = {**run_resource(run), **(labels or {})}
    return Event(name, resource, {"run": run, **payload}, related)


def model_event(name: str, model: str, payload: Mapping[str, Any]) -> Event:
    """A serving event about a model (resource ``rewind.model.<name>``)."""
    resource = {
        "prefect.resource.id": f"rewind.model.{model}",
        "prefect.resource.name": model,
        "prefect.resource.role": "model",
    }
    return Event(name, resource, {"model": model, **payload})


def artifact_key(*parts: object) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(str(p) for p in parts).lower()).strip("-")[:200]


class Notifier(Protocol):
    """Where a phase's events, artifacts and log lines go."""

    def event(self, event: Event) -> None: ...

    def table(self, *, key: str, rows: Sequence[Mapping[str, Any]], description: str) -> None: ...

    def markdown(self, *, key: str, text: str, description: str | None = None) -> None: ...

    def log(self, level: int, msg: str, *args: object) -> None: ...


class LogNotifier:
    """Events and artifacts as log lines (logger ``rewind.events``): the CLI's notifier, and any caller's
    that runs a phase without Prefect."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger("rewind")

    def event(self, event: Event) -> None:
        log.info(
            "event %s %s %s",
            event.name,
            event.resource["prefect.resource.id"],
            json.dumps(event.payload, default=str),
        )

    def table(self, *, key: str, rows: Sequence[Mapping[str, Any]], description: str) -> None:
        log.debug("artifact %s (%s): %d rows", key, description, len(rows))

    def markdown(self, *, key: str, text: str, description: str | None = None) -> None:
        log.debug("artifact %s: %s", key, text)

    def log(self, level: int, msg: str, *args: object) -> None:
        self._log.log(level, msg, *args)
