"""Every Rewind deployment, with its schedule or trigger, served by one process (`rewind serve`)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, cast

from prefect import serve
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger

from rewind.flows.drills import run_drills
from rewind.flows.maintenance import (
    adopt_checkpoints,
    expire_conversations_flow,
    replicate_offsite,
    restore_checkpoint_flow,
    verify_checkpoints,
)
from rewind.flows.serving import deploy_model, rollback_model, rollout_model
from rewind.flows.training import protect_training, recover_training
from rewind.infra.catalog.models import IncidentKind
from rewind.tasks.common import INCIDENT_KIND_LABEL

FAILURE_EVENT = "rewind.failure.detected"
# A job that failed to start would fail the same way again: the trigger leaves those incidents alone.
RECOVERABLE: dict[str, str | list[str]] = {
    "prefect.resource.id": "rewind.run.*",
    INCIDENT_KIND_LABEL: f"!{IncidentKind.FAILED_TO_START.value}",
}


def build(
    *,
    scrub_every: timedelta = timedelta(hours=6),
    replicate_every: timedelta = timedelta(minutes=15),
    replicate_to: str | None = None,
    adopt_every: timedelta = timedelta(minutes=10),
    drill_every: timedelta = timedelta(days=7),
    expire_every: timedelta = timedelta(hours=1),
) -> list[RunnerDeployment]:
    target = replicate_to or os.environ.get("REWIND_OFFSITE_URI") or os.environ.get("REWIND_SHARED_URI")
    found = [
        protect_training.to_deployment(name="protect-training", tags=["rewind", "training"]),
        _recover_deployment(),
        verify_checkpoints.to_deployment(
            name="verify-checkpoints", interval=scrub_every, tags=["rewind", "scrub"]
        ),
        restore_checkpoint_flow.to_deployment(name="restore-checkpoint", tags=["rewind", "restore"]),
        _adopt_deployment(adopt_every),
        run_drills.to_deployment(
            name="run-drills",
            interval=drill_every,
            paused=os.environ.get("REWIND_DRILLS_SCHEDULED") != "1",  # drills hurt jobs: opt in
            tags=["rewind", "drills"],
        ),
        expire_conversations_flow.to_deployment(
            name="expire-conversations", interval=expire_every, tags=["rewind", "serving"]
        ),
        deploy_model.to_deployment(name="deploy-model", tags=["rewind", "serving"]),
        rollout_model.to_deployment(name="rollout-model", tags=["rewind", "serving"]),
        rollback_model.to_deployment(name="rollback-model", tags=["rewind", "serving"]),
        _replicate_deployment(target, replicate_every),
    ]
    # ``to_deployment`` answers with a coroutine only inside an event loop: never here.
    return [cast(RunnerDeployment, d) for d in found]


def _recover_deployment() -> Any:
    """recover-training, started by every recoverable failure event."""
    return recover_training.to_deployment(
        name="recover-training",
        tags=["rewind", "training"],
        triggers=[
            DeploymentEventTrigger(
                name="recover-on-failure",
                description="Recover a training run whenever a failure is detected "
                "(not a job that failed to start: it would fail again).",
                expect={FAILURE_EVENT},
                match=RECOVERABLE,
                parameters={"incident_id": "{{ event.payload.incident_id }}"},
            )
        ],
    )


def _replicate_deployment(target: str | None, every: timedelta) -> Any:
    """replicate-offsite on a schedule and on every verified checkpoint; paused until a target is configured."""
    return replicate_offsite.to_deployment(
        name="replicate-offsite",
        interval=every,
        parameters={"target": target} if target else None,
        paused=target is None,  # nothing to replicate to until a target is configured
        tags=["rewind", "replication"],
        triggers=[
            DeploymentEventTrigger(
                name="replicate-on-verified",
                description="Replicate as soon as a checkpoint is verified.",
                expect={"rewind.checkpoint.verified"},
                match={"prefect.resource.id": "rewind.run.*"},
                parameters={"target": target, "run": "{{ event.payload.run }}"},
            )
        ]
        if target
        else None,
    )


def _adopt_deployment(every: timedelta) -> Any:
    """Adopt by hand from the UI form, or, with REWIND_ADOPT_FROM and REWIND_ADOPT_RUN set, every new
    ``checkpoint-*`` directory that appears there (paused until both are set)."""
    watch, run = os.environ.get("REWIND_ADOPT_FROM"), os.environ.get("REWIND_ADOPT_RUN")
    params = {"path": watch, "run": run, "pattern": os.environ.get("REWIND_ADOPT_PATTERN", "checkpoint-*")}
    return adopt_checkpoints.to_deployment(
        name="adopt-checkpoints",
        interval=every,
        parameters=params if watch and run else None,
        paused=not (watch and run),
        tags=["rewind", "adoption"],
    )


def serve_all(**kwargs: object) -> None:
    serve(*build(**kwargs), limit=int(os.environ.get("REWIND_SERVE_LIMIT", "8")))  # type: ignore[arg-type]
