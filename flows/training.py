"""Flows that keep a training job alive: protect it, and recover it when it dies."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from infra.errors import Refused
from tasks.common import artifact_key
from tasks.detect import (
    FAILED_TO_START,
    annotate_incident,
    check_recovery_budget,
    claim_recovery,
    load_incident,
    record_failure,
    record_spec,
    supervise_training,
)
from tasks.rebuild import rebuild_environment
from tasks.restore import restore_checkpoint
from tasks.verify import checkpoint_table


@flow(name="protect-training")
def protect_training(
    run: str,
    command: list[str],
    cwd: str | None = None,
    nproc_per_node: int = 1,
    nnodes: int = 1,
    min_world_size: int = 1,
    env: dict[str, str] | None = None,
    heartbeat_timeout_s: float | None = None,
    loss_spike_factor: float | None = None,
    global_batch: int | None = None,
    lr: float | None = None,
) -> dict[str, Any]:
    """Run a training job under watch: verify every checkpoint it commits; a failure becomes an incident.

    The job's spec is kept on the run, so recovery relaunches it the same way. Rewind never
    reads the job's flags or output: ranks report through the session API (infra.training).

    Args:
        run: Catalog name of the run; the job must checkpoint under the same name.
        command: What one process runs, one list item per argument, e.g.
            ["python", "-m", "examples.tiny_lm", "--run", "demo", "--steps", "60", "--checkpoint-every", "10", "--out", "out"];
            a leading "python" or "python3" is replaced by the worker's own interpreter (its sys.executable), so
            the job runs with the packages the worker has. A job that exits with an error before its first
            step is an incident of kind failed_to_start, with its last lines, and is not recovered automatically.
        cwd: Working directory of the command (default: the worker's).
        nproc_per_node: Processes per node; more than one starts the job under torchrun.
        nnodes: Nodes (one torchrun agent each, c10d rendezvous).
        min_world_size: After losing ranks the job may come back on as few as this many.
        env: Added to the job's environment.
        heartbeat_timeout_s: A rank whose step does not advance for this long is hung and the job stopped.
        loss_spike_factor: A loss above this multiple of the running median stops the job (NaN/Inf always do).
        global_batch: The job's global batch at full size (for the rebuild decision).
        lr: The job's learning rate at full size (for the rebuild decision).
    """
    spec = record_spec(
        run,
        {
            "command": command, "cwd": cwd, "env": env or {}, "nnodes": nnodes, "nproc_per_node": nproc_per_node,
            "min_world_size": min_world_size, "heartbeat_timeout_s": heartbeat_timeout_s,
            "loss_spike_factor": loss_spike_factor, "global_batch": global_batch, "lr": lr,
        },
    )  # fmt: skip
    outcome = supervise_training(run, spec)
    checkpoint_table(run)
    if outcome["exit_code"] == 0 and outcome["kind"] == "crash":
        return {"run": run, "status": "finished", "last_step": outcome["last_step"]}
    incident_id = record_failure(outcome)
    return {
        "run": run,
        "status": outcome["kind"],
        "incident_id": incident_id,
        "last_step": outcome["last_step"],
    }


@flow(name="recover-training")
def recover_training(
    incident_id: int, max_incidents: int = 5, window_s: float = 3600.0, shrink_on_crash: bool = True
) -> dict[str, Any]:
    """Bring a failed job back: newest verified checkpoint, relaunched from the run's spec, watched again.

    Started by the automation on `rewind.failure.detected`; can also be run by hand.

    Args:
        incident_id: The incident the failure detector recorded.
        max_incidents: Stop recovering automatically after this many incidents of the run within `window_s`.
        window_s: The window for `max_incidents`, in seconds.
        shrink_on_crash: Relaunch a job that lost ranks (or a node) on the ranks left, resharded.
    """
    log = get_run_logger()
    flow_started = time.time()
    incident = load_incident(incident_id)
    run, details = incident["run"], incident["details"]
    if incident["kind"] == FAILED_TO_START:  # run by hand: the trigger does not fire for these
        raise Refused(
            f"incident {incident_id}: {run!r} failed to start, so it is not recovered (a relaunch would fail "
            f"the same way); fix the job and run protect-training again. {incident['reason']}"
        )
    other = claim_recovery(incident_id)
    if other is not None:
        log.warning("incident %d is already being recovered by %s: nothing to do", incident_id, other)
        return {"run": run, "status": "already-recovering", "incident_id": incident_id, "by": other}
    died_at = details["died_at"]
    annotate_incident(
        incident_id,
        details={"recovery_flow_started_at": flow_started, "flow_start_s": flow_started - died_at},
    )
    check_recovery_budget(run, max_incidents, window_s)

    bad_step = details.get("bad_step")
    anomaly = incident["kind"] in ("nan", "loss_spike") and bad_step is not None
    chosen, load_s, replayed = _restore_point(
        run, incident_id, incident["kind"], details, bad_step if anomaly else None
    )
    rebuilt = rebuild_environment(run, incident_id, shrink_on_crash)
    handoff = dict(rebuilt["handoff"])
    if anomaly:  # skip the data window that produced the anomaly
        handoff["skip"] = _skip_window(incident_id, chosen, details, bad_step)
    log.info(
        "restarting %s from step %d (replaying %d steps): %s",
        run,
        chosen["step"],
        replayed,
        rebuilt["decision"],
    )

    outcome = supervise_training(run, rebuilt["spec"], handoff, incident_id=incident_id, died_at=died_at)
    checkpoint_table(run)
    timeline = _timeline(run, incident_id, died_at, flow_started, load_s, chosen, outcome, replayed)
    create_markdown_artifact(key=artifact_key("rewind", run, "recovery"), markdown=timeline)
    if outcome["exit_code"] != 0 or outcome["kind"] != "crash":
        annotate_incident(incident_id, details={"relaunch_outcome": outcome["how"]})
        next_incident = record_failure(outcome)
        return {"run": run, "status": "failed-again", "incident_id": next_incident}
    annotate_incident(incident_id, resolved=True, details={"finished_at": time.time()})
    return {
        "run": run,
        "status": "recovered",
        "restored_step": chosen["step"],
        "last_step": outcome["last_step"],
    }


def _restore_point(
    run: str, incident_id: int, kind: str, details: dict[str, Any], bad_step: int | None
) -> tuple[dict[str, Any], float, int]:
    """The restore point (before an anomaly, retiring what came after it), its seconds, the steps replayed."""
    t0 = time.time()
    if bad_step is not None:
        chosen = restore_checkpoint(
            run, roll_back=True, before_step=bad_step, reason=f"after the {kind} at step {bad_step}"
        )
    else:
        chosen = restore_checkpoint(run)
    load_s = time.time() - t0
    replayed = (details.get("last_step") or chosen["step"]) - chosen["step"]
    annotate_incident(
        incident_id, load_s=load_s, restored_checkpoint_id=chosen["checkpoint_id"], replayed_steps=replayed
    )
    return chosen, load_s, replayed


def _skip_window(
    incident_id: int, chosen: dict[str, Any], details: dict[str, Any], bad_step: int
) -> list[int] | None:
    """[from, to) of the data that produced the anomaly: from the restore point to where the bad step ended."""
    start, end = chosen["data"].get("total", chosen["data"]["consumed"]), details.get("anomaly_position")
    if end is None or end <= start:
        annotate_incident(
            incident_id, details={"skipped_samples": None, "skip": "the job reported no data position"}
        )
        return None
    annotate_incident(
        incident_id,
        details={"skipped_samples": [start, end], "skipped_steps": [chosen["step"] + 1, bad_step]},
    )
    return [start, end]


def _timeline(
    run: str,
    incident_id: int,
    died_at: float,
    flow_started: float,
    load_s: float,
    chosen: dict[str, Any],
    outcome: dict[str, Any],
    replayed: int,
) -> str:
    first = outcome.get("first_step_at")
    rows = [
        ("training died", 0.0),
        ("recovery flow started", flow_started - died_at),
        ("restore point verified", flow_started - died_at + load_s),
        ("first step after restore", (first - died_at) if first else None),
    ]
    lines = [
        f"# Recovery of `{run}` (incident {incident_id})",
        "",
        "| event | seconds after the failure |",
        "|---|---|",
    ]
    lines += [f"| {name} | {'-' if t is None else f'{t:.2f}'} |" for name, t in rows]
    lines += ["", f"Restored step {chosen['step']}; replayed {replayed} steps; relaunch {outcome['how']}."]
    return "\n".join(lines)
