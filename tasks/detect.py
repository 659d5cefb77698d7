"""Phase 4, detect, and the record of a recovery: thin Prefect tasks over ``phases.detect`` and
``phases.recovery``."""

from __future__ import annotations

import logging
from typing import Any

from prefect import task

from rewind.infra.catalog import jobs, leases
from rewind.infra.errors import NotFoundError, RunBusy
from rewind.infra.launch import workdir
from rewind.infra.launch.spec import JobSpec
from rewind.infra.phases import detect, recovery
from rewind.infra.phases.detect import Outcome
from rewind.infra.phases.recovery import Finished, Recovery
from rewind.infra.phases.restore import RestorePoint
from rewind.tasks.common import NO_CACHE, RETRY, catalog, notifier
from rewind.tasks.progress import TrainingView
from rewind.tasks.verify import verify_checkpoint


def _verify(checkpoint_id: int) -> bool:
    """Each committed checkpoint, deep-verified as its own task run (retried on a transient fault)."""
    state = verify_checkpoint(checkpoint_id, deep=True, return_state=True)
    if state.is_failed():
        notifier().log(logging.ERROR, "checkpoint %s failed verification: %s", checkpoint_id, state.message)
    return state.is_completed()


@task(name="supervise-training", retries=0, cache_policy=NO_CACHE)
def supervise_training(
    run: str,
    spec: dict[str, Any],
    handoff: dict[str, Any] | None = None,
    incident_id: int | None = None,
    died_at: float | None = None,
    poll_s: float = 1.0,
    gpu_check_s: float | None = 30.0,
) -> Outcome:
    """Launch the run from ``spec`` and watch it to its end; verify each checkpoint as it is committed."""
    view = TrainingView(run)
    return detect.supervise(
        catalog(), run=run, spec=JobSpec.from_dict(spec), notify=notifier(), verify=_verify, show=view.show,
        handoff=handoff, incident_id=incident_id, died_at=died_at, poll_s=poll_s, gpu_check_s=gpu_check_s,
    )  # fmt: skip


@task(name="record-spec", **RETRY)
def record_spec(run: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Keep how the run is launched in the catalog; recovery relaunches from it. Returns it, checked. A run
    another live process writes keeps its spec (``RunBusy``): its recoveries must relaunch that job."""
    checked = JobSpec.from_dict(spec).as_dict()
    refuse_live_writer.fn(run)
    jobs.set_spec(catalog(), run, checked)
    return checked


@task(name="refuse-live-writer", **RETRY)
def refuse_live_writer(run: str) -> None:
    """``RunBusy`` when a live process writes ``run``: nothing may relaunch it, roll it back or respec it."""
    busy = leases.live_writer(catalog(), run)
    if busy is not None:
        raise RunBusy(
            f"run {run!r} is being written by {busy}: stop it first (nothing of the run was changed)"
        )


@task(name="relaunch-spec", **RETRY)
def relaunch_spec(run: str, command: list[str], cwd: str | None) -> dict[str, Any]:
    """The run's job spec with ``command`` and ``cwd`` (None: its own) in its own's place (its size,
    environment and watch settings kept), checked; not recorded: the caller records it once the roll-back is done."""
    try:
        base = jobs.get_spec(catalog(), run)
    except NotFoundError:  # a run never launched by Rewind: the command is all there is
        base = {}
    where = workdir.job_cwd(run, cwd) if cwd else base.get("cwd") or workdir.job_cwd(run, None)
    return JobSpec.from_dict({**base, "command": command, "cwd": where}).as_dict()


@task(name="load-spec", **RETRY)
def load_spec(run: str) -> dict[str, Any]:
    return jobs.get_spec(catalog(), run)


@task(name="record-failure", **RETRY)
def record_failure(outcome: Outcome) -> int:
    """One incident and one ``rewind.failure.detected`` event per abnormal end, however often retried."""
    return detect.record_failure(catalog(), outcome=outcome, notify=notifier())


@task(name="begin-recovery", **RETRY)
def begin_recovery(incident_id: int, max_incidents: int, window_s: float) -> Recovery:
    """Make this flow run the one recovery of the incident (a failure event delivered twice, or a recovery
    started by hand beside the automatic one, must not relaunch the job twice); refuse a job that failed
    to start and a crash loop."""
    from prefect.runtime import flow_run

    me = f"flow-run:{flow_run.id or 'local'}"
    return recovery.begin(
        catalog(), incident_id=incident_id, claimant=me, max_incidents=max_incidents, window_s=window_s
    )


@task(name="record-restore", **RETRY)
def record_restore(found: Recovery, point: RestorePoint, load_s: float) -> dict[str, Any]:
    """The restore point on the incident; what the relaunch is handed to load it (and data to skip)."""
    return recovery.restored(catalog(), recovery=found, point=point, load_s=load_s)


@task(name="finish-recovery", **RETRY)
def finish_recovery(found: Recovery, point: RestorePoint, load_s: float, outcome: Outcome) -> Finished:
    """The timeline artifact; the incident resolved, or the relaunch's failure recorded as a new one."""
    return recovery.finish(
        catalog(), recovery=found, point=point, load_s=load_s, outcome=outcome, notify=notifier()
    )
