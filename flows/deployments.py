"""Every Rewind deployment, with its schedule or trigger: one table, served by one process (`rewind serve`)
and written out as `prefect.yaml` for a work pool (`rewind.flows.prefect_yaml`), so the two cannot drift."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

from prefect import Flow, serve
from prefect.deployments.runner import RunnerDeployment
from prefect.events import DeploymentEventTrigger

from rewind.infra.catalog.models import IncidentKind
from rewind.tasks.common import INCIDENT_KIND_LABEL

FAILURE_EVENT = "rewind.failure.detected"
# A job that failed to start would fail the same way again: the trigger leaves those incidents alone.
RECOVERABLE: dict[str, str | list[str]] = {
    "prefect.resource.id": "rewind.run.*",
    INCIDENT_KIND_LABEL: f"!{IncidentKind.FAILED_TO_START.value}",
}


@dataclass(frozen=True, kw_only=True)
class TriggerSpec:
    """An event trigger of a deployment. Its parameters are Jinja over the event, rendered by the server:
    per-site values (targets, paths) come from the environment the flow runs in, never from here."""

    name: str
    description: str
    expect: str
    match: Mapping[str, str | list[str]]
    parameters: Mapping[str, str]

    def runner_trigger(self) -> DeploymentEventTrigger:
        return DeploymentEventTrigger(
            name=self.name,
            description=self.description,
            expect={self.expect},
            match=dict(self.match),
            parameters=dict(self.parameters),
        )


@dataclass(frozen=True, kw_only=True)
class DeploymentSpec:
    """One deployment. ``flow`` is the flow function's module path in the installed package (a work pool's
    worker imports it from there: no code is pulled, no working directory assumed). ``paused`` is how a
    deployment starts when nothing in the environment configures it; ``note`` says what unpauses it."""

    name: str
    flow: str
    tags: tuple[str, ...]
    interval: timedelta | None = None
    paused: bool = False
    triggers: tuple[TriggerSpec, ...] = ()
    concurrency_limit: int | None = None  # runs of this deployment at once (None: no limit)
    note: str = ""
    budget_share: float | None = (
        None  # a scheduled run's budget_s: this share of the interval (done before the next)
    )

    def budget(self, interval: timedelta | None = None) -> dict[str, Any]:
        """The scheduled runs' ``budget_s`` parameter for ``interval`` (None: the table's), if it has one."""
        every = interval or self.interval
        return {"budget_s": self.budget_share * every.total_seconds()} if self.budget_share and every else {}

    def load_flow(self) -> Flow[..., Any]:
        module, _, attr = self.flow.rpartition(".")
        return cast(Flow[..., Any], getattr(importlib.import_module(module), attr))


RECOVER_ON_FAILURE = TriggerSpec(
    name="recover-on-failure",
    description="Recover a training run whenever a failure is detected "
    "(not a job that failed to start: it would fail again).",
    expect=FAILURE_EVENT,
    match=RECOVERABLE,
    parameters={"incident_id": "{{ event.payload.incident_id }}"},
)
REPLICATE_ON_VERIFIED = TriggerSpec(
    name="replicate-on-verified",
    description="Replicate as soon as a checkpoint is verified.",
    expect="rewind.checkpoint.verified",
    match={"prefect.resource.id": "rewind.run.*"},
    parameters={"run": "{{ event.payload.run }}"},  # the target: the flow's default, REWIND_OFFSITE_URI
)

DEPLOYMENTS: tuple[DeploymentSpec, ...] = (
    DeploymentSpec(
        name="protect-training", flow="rewind.flows.training.protect_training", tags=("rewind", "training")
    ),
    DeploymentSpec(
        name="recover-training",
        flow="rewind.flows.training.recover_training",
        tags=("rewind", "training"),
        triggers=(RECOVER_ON_FAILURE,),
    ),
    DeploymentSpec(
        name="verify-checkpoints",
        flow="rewind.flows.maintenance.verify_checkpoints",
        tags=("rewind", "scrub"),
        interval=timedelta(hours=6),
        concurrency_limit=1,  # one scrub at a time: a slow one is never overtaken by the next
        budget_share=0.9,  # and each ends before the next is due
    ),
    DeploymentSpec(
        name="restore-checkpoint",
        flow="rewind.flows.maintenance.restore_checkpoint_flow",
        tags=("rewind", "restore"),
    ),
    DeploymentSpec(
        name="adopt-checkpoints",
        flow="rewind.flows.maintenance.adopt_checkpoints",
        tags=("rewind", "adoption"),
        interval=timedelta(minutes=10),
        paused=True,
        note="Adopt from the UI form; to adopt each new checkpoint-* directory under a path, set the "
        "schedule's parameters (path, run) and unpause it.",
    ),
    DeploymentSpec(
        name="replicate-offsite",
        flow="rewind.flows.maintenance.replicate_offsite",
        tags=("rewind", "replication"),
        interval=timedelta(minutes=15),
        paused=True,
        triggers=(REPLICATE_ON_VERIFIED,),
        note="Paused until a target is configured: set REWIND_OFFSITE_URI in the worker's environment, "
        "then unpause the schedule and enable the trigger.",
    ),
    DeploymentSpec(
        name="run-drills",
        flow="rewind.flows.drills.run_drills",
        tags=("rewind", "drills"),
        interval=timedelta(days=7),
        paused=True,
        note="Recovery drills (rewind drill): weekly once unpaused (they start and hurt a job); the UI "
        "form picks scenarios.",
    ),
    DeploymentSpec(
        name="expire-conversations",
        flow="rewind.flows.maintenance.expire_conversations_flow",
        tags=("rewind", "serving"),
        interval=timedelta(hours=1),
    ),
    DeploymentSpec(name="deploy-model", flow="rewind.flows.serving.deploy_model", tags=("rewind", "serving")),
    DeploymentSpec(
        name="rollout-model", flow="rewind.flows.serving.rollout_model", tags=("rewind", "serving")
    ),
    DeploymentSpec(
        name="rollback-model", flow="rewind.flows.serving.rollback_model", tags=("rewind", "serving")
    ),
)


@dataclass(frozen=True)
class Served:
    """What `rewind serve` takes from its environment for one deployment."""

    paused: bool
    parameters: dict[str, Any] | None = None
    triggers: bool = True


def build(
    *,
    scrub_every: timedelta | None = None,
    replicate_every: timedelta | None = None,
    replicate_to: str | None = None,
    adopt_every: timedelta | None = None,
    drill_every: timedelta | None = None,
    expire_every: timedelta | None = None,
) -> list[RunnerDeployment]:
    """The table as runner deployments, with what this process's environment configures."""
    every = {
        "verify-checkpoints": scrub_every,
        "replicate-offsite": replicate_every,
        "adopt-checkpoints": adopt_every,
        "run-drills": drill_every,
        "expire-conversations": expire_every,
    }
    served = _served(replicate_to)
    return [_runner(spec, every.get(spec.name), served.get(spec.name)) for spec in DEPLOYMENTS]


def _served(replicate_to: str | None) -> dict[str, Served]:
    target = replicate_to or os.environ.get("REWIND_OFFSITE_URI") or os.environ.get("REWIND_SHARED_URI")
    watch, run = os.environ.get("REWIND_ADOPT_FROM"), os.environ.get("REWIND_ADOPT_RUN")
    adopt = {"path": watch, "run": run, "pattern": os.environ.get("REWIND_ADOPT_PATTERN", "checkpoint-*")}
    return {
        # nothing to replicate to until a target is configured
        "replicate-offsite": Served(
            target is None, {"target": target} if target else None, target is not None
        ),
        # with REWIND_ADOPT_FROM and REWIND_ADOPT_RUN set: every new checkpoint-* directory that appears there
        "adopt-checkpoints": Served(not (watch and run), adopt if watch and run else None),
        "run-drills": Served(os.environ.get("REWIND_DRILLS_SCHEDULED") != "1"),  # drills hurt jobs: opt in
    }


def _runner(spec: DeploymentSpec, interval: timedelta | None, served: Served | None) -> RunnerDeployment:
    served = served or Served(spec.paused)
    made = spec.load_flow().to_deployment(
        name=spec.name,
        interval=(interval if interval is not None else spec.interval) if spec.interval else None,
        paused=served.paused if spec.interval else None,
        parameters={**spec.budget(interval), **(served.parameters or {})} or None,
        concurrency_limit=spec.concurrency_limit,
        tags=list(spec.tags),
        triggers=[t.runner_trigger() for t in spec.triggers] if served.triggers and spec.triggers else None,
    )
    # ``to_deployment`` answers with a coroutine only inside an event loop: never here.
    return cast(RunnerDeployment, made)


def serve_all(**kwargs: Any) -> None:
    deployments = build(**kwargs)
    print(banner([d.name for d in deployments]), flush=True)
    # Prefect's own banner suggests `prefect deployment run`, which lacks `rewind server`'s credential.
    serve(*deployments, limit=int(os.environ.get("REWIND_SERVE_LIMIT", "8")), print_starting_message=False)


def banner(names: list[str]) -> str:
    """What `rewind serve` says it serves, and how to start a run with the credential it found."""
    from prefect.settings import PREFECT_UI_URL

    ui = PREFECT_UI_URL.value()
    return "\n".join([
        f"rewind serve: {len(names)} deployments served from this process (Ctrl-C stops them):",
        *(f"  {name}" for name in names),
        "start one from the UI" + (f" ({ui}/deployments)" if ui else "")
        + " or a shell: rewind run DEPLOYMENT -p NAME=VALUE ...",
    ])  # fmt: skip
