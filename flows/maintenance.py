"""Flows run on schedules or by hand: scrub, restore a chosen step, replicate."""

from __future__ import annotations

import os
from typing import Any

from prefect import flow
from prefect.artifacts import create_table_artifact

from tasks.common import artifact_key
from tasks.detect import record_failure, supervise_training
from tasks.replicate import pending_replication, replicate_checkpoint
from tasks.restore import restore_checkpoint
from tasks.verify import list_checkpoints, verify_checkpoint


@flow(name="verify-checkpoints")
def verify_checkpoints(run: str | None = None, deep: bool = True) -> dict[str, Any]:
    """Re-verify (scrub) committed checkpoints; any corrupt one fails the run and is reported.

    Args:
        run: Only this run (default: every run in the catalog).
        deep: Re-read and re-hash every byte (otherwise sizes and manifests only).
    """
    rows = []
    for ck in list_checkpoints(run):
        state = verify_checkpoint(ck["checkpoint_id"], deep=deep, return_state=True)
        ok = state.is_completed()
        rows.append({**ck, "ok": ok, "detail": "" if ok else state.message})
    if rows:
        create_table_artifact(
            key=artifact_key("rewind", run or "all", "scrub"), table=rows, description="Scrub results"
        )
    bad = [r for r in rows if not r["ok"]]
    if bad:
        raise RuntimeError(
            f"{len(bad)} of {len(rows)} checkpoints are corrupt: "
            + ", ".join(f"{r['run']}@{r['step']}" for r in bad)
        )
    return {"checked": len(rows), "corrupt": 0}


@flow(name="restore-checkpoint")
def restore_checkpoint_flow(
    run: str, step: int | None = None, relaunch_command: list[str] | None = None, cwd: str | None = None
) -> dict[str, Any]:
    """Roll a run back to a verified checkpoint; its next launch resumes from there.

    Args:
        run: Catalog name of the run.
        step: The step to go back to (default: the newest checkpoint that verifies).
        relaunch_command: If given, start the job again with this command and watch it.
        cwd: Working directory for the relaunch.
    """
    chosen = restore_checkpoint(
        run, step, roll_back=True, reason=f"rolled back to step {step} from the restore-checkpoint flow"
    )
    if not relaunch_command:
        return chosen
    outcome = supervise_training(run, relaunch_command, cwd)
    if outcome["exit_code"] != 0:
        chosen["incident_id"] = record_failure(outcome)
    chosen["relaunch"] = outcome["how"]
    return chosen


@flow(name="replicate-offsite")
def replicate_offsite(target: str | None = None, run: str | None = None) -> dict[str, Any]:
    """Copy every committed checkpoint without a verified copy there to a shared path or S3.

    Args:
        target: s3://bucket/prefix, or an absolute path for a shared filesystem; default REWIND_SHARED_URI.
        run: Only this run (default: every run).
    """
    target = target or os.environ.get("REWIND_SHARED_URI")
    if not target:
        raise ValueError("no replication target: pass `target` or set REWIND_SHARED_URI")
    done = [replicate_checkpoint(ck_id, target) for ck_id in pending_replication(target, run)]
    return {"replicated": len(done), "bytes_sent": sum(d["bytes_sent"] for d in done)}
