"""Flows that keep a training job alive: protect it, and recover it when it dies."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.states import State

from rewind.flows.job_parameters import checked_cwd
from rewind.flows.run_failed import failed, quiet_expected_failures, summary
from rewind.infra.phases import recovery
from rewind.infra.phases.detect import crash_reason
from rewind.tasks.detect import (
    begin_recovery,
    finish_recovery,
    record_failure,
    record_restore,
    record_spec,
    supervise_training,
)
from rewind.tasks.rebuild import rebuild_environment
from rewind.tasks.restore import restore_checkpoint
from rewind.tasks.verify import checkpoint_table

quiet_expected_failures()
__all__ = ["protect_training", "recover_training", "summary"]


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
    launcher: str = "local",
    warm: bool = False,
    tp: int | None = None,
    pp: int | None = None,
) -> dict[str, Any] | State:
    """Run a training job under watch: verify every checkpoint it commits; a failure becomes an incident.

    A job that crashed, hung, hit an anomaly or failed to start ends the flow run Failed, the incident
    and its reason in the state's message (the recovery trigger keys on Rewind's event, not on the state).

    The job's spec is kept on the run, so recovery relaunches it the same way. Rewind never
    reads the job's flags or output: ranks report through the session API (rewind.infra.training).

    Args:
        run: Catalog name of the run; the job must checkpoint under the same name.
        command: What one process runs, one list item per argument, e.g.
            ["python", "-m", "rewind.examples.tiny_lm", "--run", "demo", "--steps", "60", "--checkpoint-every", "10", "--out", "out"];
            a leading "python" or "python3" is replaced by the worker's own interpreter (its sys.executable), so
            the job runs with the packages the worker has. A job that exits with an error before its first
            step is an incident of kind failed_to_start, with its last lines, and is not recovered automatically.
        cwd: Working directory of the command (default: the directory the flow runs in; under a process worker
            without a working_dir, whose directory goes with the flow run, ~/.rewind/jobs/RUN, recorded for
            recoveries).
        nproc_per_node: Processes per node; more than one starts the job under torchrun.
        nnodes: Nodes (one torchrun agent each, c10d rendezvous).
        min_world_size: After losing ranks the job may come back on as few as this many.
        env: Added to the job's environment. No secrets: the Prefect server keeps and shows a flow run's
            parameters (a secret-named variable or flag, or a URL with a password, is refused); set them in
            the worker's environment, which the job inherits.
        heartbeat_timeout_s: A rank whose step does not advance for this long is hung and the job stopped.
        loss_spike_factor: A loss above this multiple of the running median stops the job (NaN/Inf always do).
        global_batch: The job's global batch at full size (for the rebuild decision).
        lr: The job's learning rate at full size (for the rebuild decision).
        launcher: Where the nodes run: "local" (processes of the worker) or "slurm" (an allocation of
            nnodes hosts, one srun per node; a lost host is left out of the relaunch, a spare takes its place).
        warm: Relaunch from a standby interpreter that already imported the job's modules (a one-process
            "python -m MODULE" or "python SCRIPT" job on the local launcher): seconds instead of a cold start.
        tp: Tensor-parallel degree the first launch is handed (REWIND_LAYOUT); a relaunch is handed the
            rebuild's choice for the devices left.
        pp: Pipeline stages the first launch is handed; DP is the rest of the world size.
    """
    spec = record_spec(
        run,
        {
            "command": command, "cwd": checked_cwd(run, command, cwd, env), "env": env or {}, "nnodes": nnodes, "nproc_per_node": nproc_per_node,
            "min_world_size": min_world_size, "heartbeat_timeout_s": heartbeat_timeout_s,
            "loss_spike_factor": loss_spike_factor, "global_batch": global_batch, "lr": lr, "launcher": launcher,
            "warm": warm, "layout": {"tp": tp or 1, "pp": pp or 1} if tp or pp else None,
        },
    )  # fmt: skip
    outcome = supervise_training(run, spec)
    checkpoint_table(run)
    if outcome.finished:
        return {"run": run, "status": "finished", "last_step": outcome.last_step}
    incident_id = record_failure(outcome)
    found = {
        "run": run,
        "status": str(outcome.kind),
        "incident_id": incident_id,
        "last_step": outcome.last_step,
    }
    return failed(f"{outcome.kind}, incident {incident_id}: {crash_reason(outcome)}", found)


@flow(name="recover-training")
def recover_training(
    incident_id: int, max_incidents: int = 5, window_s: float = 3600.0, shrink_on_crash: bool = True
) -> dict[str, Any] | State:
    """Bring a failed job back: the newest checkpoint that proves itself, relaunched from the run's spec, watched again.

    Started by the automation on `rewind.failure.detected`; can also be run by hand.

    Args:
        incident_id: The incident the failure detector recorded.
        max_incidents: Stop recovering automatically after this many incidents of the run within `window_s`.
        window_s: The window for `max_incidents`, in seconds.
        shrink_on_crash: Relaunch a job that lost ranks (or a node) on the ranks left, resharded.
    """
    found = begin_recovery(incident_id, max_incidents, window_s)
    if found.held_by is not None:
        get_run_logger().warning(
            "incident %d is already being recovered by %s: nothing to do", incident_id, found.held_by
        )
        return {
            "run": found.run,
            "status": "already-recovering",
            "incident_id": incident_id,
            "by": found.held_by,
        }
    t0 = time.time()
    # The job hashes every byte as it loads the restore point: here only its manifest is proven.
    if found.anomaly:  # the newest checkpoint before the anomaly, the ones after it retired
        why = f"after the {found.kind} at step {found.bad_step}"
        point = restore_checkpoint(
            found.run, roll_back=True, before_step=found.bad_step, reason=why, proof="manifest",
            lost_hosts=list(found.lost_hosts),
        )  # fmt: skip
    else:
        point = restore_checkpoint(found.run, proof="manifest", lost_hosts=list(found.lost_hosts))
    load_s = time.time() - t0
    rebuilt = rebuild_environment(found.run, incident_id, shrink_on_crash, point.checkpoint_id)
    handoff = {**rebuilt.handoff, **record_restore(found, point, load_s)}
    get_run_logger().info(
        "restarting %s from step %d (replaying at least %d steps, to its last reported one): %s",
        found.run, point.step, (found.last_step or point.step) - point.step, rebuilt.decision,
    )  # fmt: skip
    outcome = supervise_training(
        found.run, dict(rebuilt.spec), handoff, incident_id=incident_id, died_at=found.died_at
    )
    checkpoint_table(found.run)
    done = dict(recovery.as_summary(finish_recovery(found, point, load_s, outcome), found))
    if done["status"] == "recovered":
        return done
    why = f"the relaunch failed again ({done['status']}, incident {done.get('incident_id')}): {crash_reason(outcome)}"
    return failed(why, done)
