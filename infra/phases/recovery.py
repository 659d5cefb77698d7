"""The record of one recovery, owned here: from the incident the detector opened to its resolution.

``begin`` loads the incident, refuses what must not be recovered (a job that failed to
start, a crash loop past its budget) and makes the caller the incident's one recovery;
``restored`` records the restore point (and, after an anomaly, the data window the job
must step over), returning what the relaunch is handed; ``finish`` writes the timeline
and resolves the incident, or records the relaunch's own failure as a new one.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import IncidentKind
from rewind.infra.errors import Refused
from rewind.infra.launch.supervisor import NOT_STARTED, PLACEMENT_FAILED
from rewind.infra.phases import detect
from rewind.infra.phases.detect import Outcome
from rewind.infra.phases.notify import Notifier, artifact_key
from rewind.infra.phases.restore import RestorePoint
from rewind.infra.training import comeback, progress

ANOMALIES = (IncidentKind.NAN, IncidentKind.LOSS_SPIKE)
_NEVER_RAN = (PLACEMENT_FAILED, NOT_STARTED)  # launches that never got a host, or whose command never started


@dataclass(frozen=True, slots=True)
class Recovery:
    """One recovery of one incident, as ``begin`` found it."""

    incident_id: int
    run: str
    kind: IncidentKind
    reason: str
    died_at: float
    last_step: int | None
    bad_step: int | None  # the step an anomaly was seen at
    anomaly_position: int | None  # where the data loader was when it was seen
    flow_started: float
    held_by: str | None = None  # another recovery already acting on the incident: nothing to do
    lost_hosts: tuple[str, ...] = ()  # hosts the scheduler reported gone (their disks with them)

    @property
    def anomaly(self) -> bool:
        return self.kind in ANOMALIES and self.bad_step is not None


def begin(cat: Catalog, *, incident_id: int, claimant: str, max_incidents: int, window_s: float) -> Recovery:
    """Claim the incident's recovery for ``claimant``; ``Refused`` for what must not be recovered."""
    started = time.time()
    inc = incidents.get_incident(cat, incident_id)
    run, details = lineage.get_run_by_id(cat, inc.run_id).name, dict(inc.details or {})
    if inc.kind == IncidentKind.FAILED_TO_START:  # run by hand: the trigger does not fire for these
        raise Refused(
            f"incident {incident_id}: {run!r} failed to start, so it is not recovered (a relaunch would fail "
            f"the same way); fix the job and run protect-training again. {inc.reason}"
        )
    if inc.recovered_by is None:  # a duplicate recovery of a claimed incident stays a no-op below
        _refuse_overtaken(cat, run, incident_id, details.get("launch_id"))
    holder = incidents.claim_recovery(cat, incident_id, claimant)
    found = Recovery(
        incident_id, run, IncidentKind(inc.kind), inc.reason or "", float(details["died_at"]), details.get("last_step"),
        details.get("bad_step"), details.get("anomaly_position"), started, None if holder == claimant else holder,
        tuple(details.get("lost_hosts") or ()),
    )  # fmt: skip
    if found.held_by is not None:
        return found
    details_now = {"recovery_flow_started_at": started, "flow_start_s": started - found.died_at}
    incidents.update_incident(cat, incident_id, details=details_now)
    n = incidents.recent_count(cat, run, window_s)
    if n > max_incidents:
        raise Refused(
            f"run {run!r} had {n} incidents in the last {window_s:.0f}s (limit {max_incidents}); "
            "not recovering automatically"
        )
    return found


def _refuse_overtaken(cat: Catalog, run: str, incident_id: int, launch_id: Any) -> None:
    """An incident of a launch the run has moved past (started again by hand while the recovery waited,
    or recovered already): recovering it would roll back what the newer launch saved and start a second job."""
    if launch_id is None:
        return
    newer = [
        launch.id
        for launch in jobs.launches(cat, run)
        if launch.id > int(launch_id) and launch.exit_code not in _NEVER_RAN
    ]
    if newer:
        raise Refused(
            f"incident {incident_id}: {run!r} was launched again since (launch {max(newer)}): not recovering "
            "a run that has moved on; recover-training with the newer incident, if it has one"
        )


def restored(cat: Catalog, *, recovery: Recovery, point: RestorePoint, load_s: float) -> dict[str, Any]:
    """Record the restore point on the incident; what the relaunch is handed besides the rebuild's
    handoff: the checkpoint to load and, after an anomaly, the data window to step over."""
    replayed = (recovery.last_step or point.step) - point.step
    incidents.update_incident(
        cat,
        recovery.incident_id,
        load_s=load_s,
        restored_checkpoint_id=point.checkpoint_id,
        replayed_steps=replayed,
        details={"restore_bytes_read_by_flow": point.bytes_read},
    )
    handoff: dict[str, Any] = {"restore": point.target.as_dict()}
    if recovery.anomaly:
        handoff["skip"] = _skip_window(cat, recovery, point)
    held_to = _comeback_before(cat, recovery, point)
    if held_to:  # the comeback is held to what the run did before the failure
        handoff["comeback"] = held_to
    return handoff


def _comeback_before(cat: Catalog, recovery: Recovery, point: RestorePoint) -> dict[str, Any] | None:
    """The failed launch's rank 0 losses of the steps past the restore point, its world size and layout (none after
    an anomaly: the relaunch steps over that data, so its steps are not the same)."""
    launch = (incidents.get_incident(cat, recovery.incident_id).details or {}).get("launch_id")
    if recovery.anomaly or launch is None:
        return None
    lead = [r for r in progress.read(cat, int(launch)) if r.rank == 0]
    before = comeback.before_failure(lead[0].detail.get("losses"), point.step) if lead else {}
    if not before:
        return None
    world = (jobs.get_launch(cat, int(launch)).handoff or {}).get("world_size")
    held = {str(k): v for k, v in before.items()}
    out = {"before": held, "tolerance": comeback.TOLERANCE, "world_size": world}
    return {**out, "layout": lead[0].detail["layout"]} if lead[0].detail.get("layout") else out


def _skip_window(cat: Catalog, recovery: Recovery, point: RestorePoint) -> list[int | None] | None:
    """[from, to) of the data that produced the anomaly: from the restore point to where the bad step ended."""
    end = recovery.anomaly_position
    if point.data is None and end is not None:  # its state is on the job's hosts: the job knows where it is
        incidents.update_incident(
            cat,
            recovery.incident_id,
            details={"skipped_samples": [None, end], "skipped_steps": [point.step + 1, recovery.bad_step]},
        )
        return [None, end]
    start = point.data.total if point.data is not None else 0
    if end is None or end <= start:
        details: dict[str, Any] = {"skipped_samples": None, "skip": "the job reported no data position"}
        incidents.update_incident(cat, recovery.incident_id, details=details)
        return None
    steps = [point.step + 1, recovery.bad_step]
    incidents.update_incident(
        cat, recovery.incident_id, details={"skipped_samples": [start, end], "skipped_steps": steps}
    )
    return [start, end]


@dataclass(frozen=True, slots=True)
class Finished:
    """How the recovery ended: ``recovered``, or ``failed-again`` with the relaunch's own incident."""

    status: str
    restored_step: int
    last_step: int | None
    next_incident_id: int | None = None


def finish(
    cat: Catalog,
    *,
    recovery: Recovery,
    point: RestorePoint,
    load_s: float,
    outcome: Outcome,
    notify: Notifier,
) -> Finished:
    """The recovery's timeline, then the incident resolved, or the relaunch's failure recorded. The step
    restored is the one the job loaded (the incident's, corrected at its first step if it fell back)."""
    loaded = incidents.get_incident(cat, recovery.incident_id).restored_checkpoint_id
    step = (
        lineage.get_checkpoint(cat, loaded).step if loaded not in (None, point.checkpoint_id) else point.step
    )
    came_back = _comeback_of(cat, outcome)
    if came_back is not None:
        incidents.update_incident(cat, recovery.incident_id, details={"comeback": came_back})
    timeline = _timeline(recovery, step, load_s, outcome) + _comeback_line(came_back)
    notify.markdown(key=artifact_key("rewind", recovery.run, "recovery"), text=timeline)
    if not outcome.finished:
        ended: dict[str, Any] = {"relaunch_outcome": outcome.how}
        if outcome.restore_failed:  # the restore point's bytes failed as the job read them: restore broke
            ended["restore_failed_in_job"] = outcome.restore_failed
        incidents.update_incident(cat, recovery.incident_id, details=ended)
        again = detect.record_failure(cat, outcome=outcome, notify=notify)
        return Finished("failed-again", step, outcome.last_step, again)
    incidents.update_incident(cat, recovery.incident_id, details={"finished_at": time.time()})
    incidents.resolve(cat, recovery.incident_id)
    return Finished("recovered", step, outcome.last_step)


def _comeback_of(cat: Catalog, outcome: Outcome) -> dict[str, Any] | None:
    """How the relaunch's losses compared with the same steps before the failure (rank 0's word)."""
    lead = [r for r in progress.read(cat, outcome.launch_id) if r.rank == 0]
    found = lead[0].detail.get("comeback") if lead else None
    return dict(found) if isinstance(found, dict) else None


def _timeline(recovery: Recovery, restored_step: int, load_s: float, outcome: Outcome) -> str:
    died, first = recovery.died_at, outcome.first_step_at
    started = recovery.flow_started - died
    rows: list[tuple[str, float | None]] = [
        ("training died", 0.0),
        ("recovery flow started", started),
        ("restore point chosen (manifest verified)", started + load_s),
        ("first step after restore (every byte verified by the job)", (first - died) if first else None),
    ]
    lines = [
        f"# Recovery of `{recovery.run}` (incident {recovery.incident_id})",
        "",
        "| event | seconds after the failure |",
        "|---|---|",
    ]
    lines += [f"| {name} | {'-' if t is None else f'{t:.2f}'} |" for name, t in rows]
    replayed = (recovery.last_step or restored_step) - restored_step
    lines += ["", f"Restored step {restored_step}; replayed {replayed} steps; relaunch {outcome.how}."]
    return "\n".join(lines)


def _comeback_line(c: Mapping[str, Any] | None) -> str:
    if not c or not c.get("compared"):
        return ""
    how = (
        f"diverged at step {c['diverged_at']}"
        if c.get("diverged_at") is not None
        else f"{c['identical']} identical bit for bit"
    )
    return (
        f"\n\nThe comeback: {c['compared']} step(s) compared with the same steps before the failure, {how}; "
        f"largest deviation {c['max_abs_deviation']:.3g} ({c['max_rel_deviation']:.2%}) at step {c['worst_step']}."
    )


def as_summary(found: Finished, recovery: Recovery) -> Mapping[str, Any]:
    """The recover-training flow's return value."""
    if found.status == "recovered":
        return {
            "run": recovery.run,
            "status": found.status,
            "restored_step": found.restored_step,
            "last_step": found.last_step,
        }
    return {"run": recovery.run, "status": found.status, "incident_id": found.next_incident_id}
