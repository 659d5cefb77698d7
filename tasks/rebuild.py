"""Phase 5, rebuild: decide how the job comes back, and record the decision on the incident."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.catalog import incidents
from tasks.common import RETRY, catalog

SINGLE_PROCESS = {"world_size": 1, "tp": 1, "pp": 1, "dp": 1}


@task(name="rebuild-environment", **RETRY)
def rebuild_environment(run: str, incident_id: int, command: list[str]) -> dict[str, Any]:
    """A single-process job restarts with the same layout and command; the decision is recorded."""
    decision = "restart with the same layout and command; resume from the newest verified checkpoint"
    incidents.update_incident(
        catalog(), incident_id, decision=decision, layout_before=SINGLE_PROCESS, layout_after=SINGLE_PROCESS
    )
    return {"run": run, "command": command, "layout": SINGLE_PROCESS, "decision": decision}
