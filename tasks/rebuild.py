"""Phase 5, rebuild: decide how the job comes back, and record the decision on the incident."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.catalog import incidents
from infra.health import layout
from tasks.common import RETRY, catalog


def _flag(command: list[str], name: str, default: str) -> str:
    return command[command.index(name) + 1] if name in command[:-1] else default


def _with_flag(command: list[str], name: str, value: str) -> list[str]:
    out = list(command)
    out[out.index(name) + 1] = value
    return out


@task(name="rebuild-environment", **RETRY)
def rebuild_environment(
    run: str, incident_id: int, command: list[str], shrink_on_crash: bool = True
) -> dict[str, Any]:
    """Same command for a single process; for an `--nproc N` job that crashed, one rank fewer.

    A crashed rank's device is presumed lost: the job comes back on the devices
    left, resharded from the newest verified checkpoint. The planner's layout and
    its batch-size/learning-rate consequence are recorded with the decision.
    """
    inc = incidents.get_incident(catalog(), incident_id)
    nproc = int(_flag(command, "--nproc", "1"))
    per_rank = int(_flag(command, "--batch-size", "16"))
    old = layout.Layout(tp=1, pp=1, dp=nproc)  # a data-parallel job: TP and PP stay 1
    if nproc > 1 and shrink_on_crash and inc.kind in ("crash", "gpu"):
        lr = float(_flag(command, "--lr", "3e-3"))
        plan = layout.plan(
            nproc - 1,
            layout.ModelShape(heads=1, hidden=1, layers=1),
            old,
            global_batch=per_rank * nproc,
            lr=lr,
        )
        new_command = _with_flag(command, "--nproc", str(plan.layout.world_size))
        decision = f"relaunch on {plan.layout.world_size} ranks, resharded from the newest verified checkpoint: {plan.reason}"
        after = plan.layout
    else:
        new_command, after = command, old
        decision = "restart with the same layout and command; resume from the newest verified checkpoint"
    incidents.update_incident(
        catalog(), incident_id, decision=decision, layout_before=old.as_dict(), layout_after=after.as_dict()
    )
    global_batch = per_rank * after.dp
    return {
        "run": run,
        "command": new_command,
        "layout": after.as_dict(),
        "decision": decision,
        "global_batch": global_batch,
    }
