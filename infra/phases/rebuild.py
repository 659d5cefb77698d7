"""Phase 5, rebuild: decide how the job comes back (``launch.rebuild``), and record why on the incident."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rewind.infra.catalog import disks, incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.checkpoint.sharded import PER_RANK_DATA
from rewind.infra.errors import NotFoundError
from rewind.infra.health import layout
from rewind.infra.launch import rebuild
from rewind.infra.launch.launchers import LauncherKind, launcher_for
from rewind.infra.launch.spec import JobSpec
from rewind.infra.phases.notify import Notifier


@dataclass(frozen=True, slots=True)
class Rebuilt:
    """How the job comes back: the spec of the relaunch, what it is told, and why."""

    run: str
    spec: Mapping[str, Any]
    handoff: Mapping[str, Any]
    decision: str


def _spec(cat: Catalog, run: str, details: Mapping[str, Any]) -> JobSpec:
    """The run's spec; for an incident recorded before specs existed, the command it recorded."""
    try:
        return JobSpec.from_dict(jobs.get_spec(cat, run))
    except NotFoundError:
        if not details.get("command"):
            raise
    spec = JobSpec(command=tuple(details["command"]), cwd=details.get("cwd"))
    jobs.set_spec(cat, run, spec.as_dict())
    return spec


def _hosts(
    cat: Catalog, full: JobSpec, details: Mapping[str, Any], checkpoint_id: int | None
) -> rebuild.Hosts | None:
    """For a job on a scheduler: the hosts it ran on, those lost, how many the scheduler has now, and
    those whose own disks hold the restore point (``checkpoint_id``)."""
    launcher = launcher_for(full.launcher)
    if launcher.kind is LauncherKind.LOCAL:
        return None
    lost = tuple(details.get("lost_hosts") or ())
    holding: list[str] = []
    if checkpoint_id is not None:  # only hosts the scheduler would give at once: a name never blocks a grant
        free = launcher.free()
        holding = [h for h in disks.hosts_holding(cat, checkpoint_id) if h in free and h not in lost]
    return rebuild.Hosts(
        previous=tuple(details.get("hosts") or ()), lost=lost, usable=launcher.usable(frozenset(lost)),
        holding=tuple(holding),
    )  # fmt: skip


def _recorded(cat: Catalog, checkpoint_id: int | None, failed: Mapping[str, Any]) -> rebuild.Recorded:
    """The layout and model shape the restore point was saved with (as the job's session reported them),
    and the layout the failed launch was handed."""
    saved: Mapping[str, Any] = {}
    if checkpoint_id is not None:
        saved = lineage.get_checkpoint(cat, checkpoint_id).layout or {}
    return rebuild.Recorded(
        saved=layout.Layout.from_dict(saved),
        handed=layout.Layout.from_dict(failed.get("layout")),
        shape=layout.ModelShape.from_dict(saved.get("model")),
        same_world=saved.get("data") == PER_RANK_DATA,
    )


def rebuild_environment(
    cat: Catalog,
    *,
    run: str,
    incident_id: int,
    notify: Notifier,
    shrink_on_crash: bool = True,
    checkpoint_id: int | None = None,
) -> Rebuilt:
    """The spec and handoff of the relaunch: fewer ranks for a crash that cost devices, else the same.

    Planned from the run's spec (its full size), the launch that failed, and the failure; the TP x PP x
    DP from the layout the restore point (``checkpoint_id``) was saved with; on a scheduler, hosts whose
    own disks hold the restore point are asked for first. The
    decision, the layout before and after, and what the job is told (world size, global batch,
    learning-rate scale) are recorded on the incident.
    """
    inc = incidents.get_incident(cat, incident_id)
    details = inc.details or {}
    full = _spec(cat, run, details)
    launch_id = details.get("launch_id")
    size = jobs.get_launch(cat, launch_id).spec if launch_id else full.as_dict()
    # The failed launch's size; everything else (its environment included) from the run's spec.
    current = full.resized(nnodes=int(size["nnodes"]), nproc_per_node=int(size["nproc_per_node"]))
    hosts = _hosts(cat, full, details, checkpoint_id)
    # a group that failed its smoke test cost no devices: the same layout again
    shrink = shrink_on_crash and details.get("failed_phase") != "rebuild"
    failed = jobs.get_launch(cat, launch_id).handoff if launch_id else {}
    devices = rebuild.Devices(  # what a GPU stop saw, else what the failed launch was handed
        every=tuple(details.get("gpus") or (failed or {}).get("gpus") or ()),
        sick=tuple(details.get("sick_gpus") or ()),
        excluded=tuple((failed or {}).get("exclude_gpus") or ()),
    )
    r = rebuild.plan(
        full,
        current,
        inc.kind,
        lost_node=details.get("lost_node"),
        shrink=shrink,
        hosts=hosts,
        devices=devices,
        recorded=_recorded(cat, checkpoint_id, failed or {}),
    )
    incidents.update_incident(
        cat,
        incident_id,
        decision=r.decision,
        layout_before=r.before.as_dict(),
        layout_after=r.after.as_dict(),
        details={"handoff": r.handoff},
    )
    notify.log(logging.INFO, "rebuild of %s: %s", run, r.decision)
    return Rebuilt(run, r.spec.as_dict(), r.handoff, r.decision)
