"""Phase 5, rebuild: decide how the job comes back (infra.launch.rebuild), and record why on the incident."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task

from infra.catalog import incidents, jobs
from infra.errors import NotFoundError
from infra.launch import rebuild
from infra.launch.spec import JobSpec
from tasks.common import RETRY, catalog


def _spec(run: str, details: dict[str, Any]) -> JobSpec:
    """The run's spec; for an incident recorded before specs existed, the command it recorded."""
    cat = catalog()
    try:
        return JobSpec.from_dict(jobs.get_spec(cat, run))
    except NotFoundError:
        if not details.get("command"):
            raise
    spec = JobSpec(command=tuple(details["command"]), cwd=details.get("cwd"))
    jobs.set_spec(cat, run, spec.as_dict())
    return spec


@task(name="rebuild-environment", **RETRY)
def rebuild_environment(run: str, incident_id: int, shrink_on_crash: bool = True) -> dict[str, Any]:
    """The spec and handoff of the relaunch: fewer ranks for a crash that cost devices, else the same.

    Planned from the run's spec (its full size), the launch that failed, and the
    failure; the decision, the layout before and after, and what the job is told
    (world size, global batch, learning-rate scale) are recorded on the incident.
    """
    cat = catalog()
    inc = incidents.get_incident(cat, incident_id)
    full = _spec(run, inc.details or {})
    launch_id = (inc.details or {}).get("launch_id")
    size = jobs.get_launch(cat, launch_id).spec if launch_id else full.as_dict()
    # The failed launch's size; everything else (its environment included) from the run's spec.
    current = full.resized(nnodes=int(size["nnodes"]), nproc_per_node=int(size["nproc_per_node"]))
    lost = (inc.details or {}).get("lost_node")
    r = rebuild.plan(full, current, inc.kind, lost_node=lost, shrink=shrink_on_crash)
    incidents.update_incident(
        cat,
        incident_id,
        decision=r.decision,
        layout_before=r.before.as_dict(),
        layout_after=r.after.as_dict(),
        details={"handoff": r.handoff},
    )
    get_run_logger().info("rebuild of %s: %s", run, r.decision)
    return {"run": run, "spec": r.spec.as_dict(), "handoff": r.handoff, "decision": r.decision}
