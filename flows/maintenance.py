"""Flows run on schedules or by hand: scrub, restore a chosen step, replicate."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.states import State

from rewind.flows.job_parameters import refuse_secrets
from rewind.flows.run_failed import failed, quiet_expected_failures
from rewind.infra.errors import ConfigError, RewindError
from rewind.infra.format.verify import DEFAULT_BUDGET_S
from rewind.infra.phases import replicate
from rewind.tasks.adopt import adopt_checkpoint, find_unadopted
from rewind.tasks.common import artifact_key
from rewind.tasks.detect import (
    load_spec,
    record_failure,
    record_spec,
    refuse_live_writer,
    relaunch_spec,
    supervise_training,
)
from rewind.tasks.replicate import apply_retention, pending_replication, replicate_checkpoint
from rewind.tasks.restore import restore_checkpoint
from rewind.tasks.sessions import expire_conversations
from rewind.tasks.verify import check_catalog, list_checkpoints, status_overview, verify_checkpoint

UNCHECKED = "unchecked: the scrub's budget ran out before it"

quiet_expected_failures()


@flow(name="verify-checkpoints")
def verify_checkpoints(
    run: str | None = None, deep: bool = True, budget_s: float = DEFAULT_BUDGET_S
) -> dict[str, Any]:
    """Re-verify (scrub) committed checkpoints, check the catalog against storage both ways, publish the status.

    Any corrupt checkpoint fails the run and is reported; drift (files no catalog
    row names, rows whose files are gone) is published as the catalog-check artifact.

    Args:
        run: Only this run (default: every run in the catalog).
        deep: Re-read and re-hash every byte (otherwise sizes and manifests only).
        budget_s: The checks' bound, retries included (default 6 h; `rewind serve` passes 90% of its
            scrub interval): what they do not reach is reported unchecked, and the next scrub takes
            the least recently checked first.
    """
    deadline = time.time() + budget_s  # a wall clock: the task's retries share it too
    rows = []
    for ck in list_checkpoints(run):
        if time.time() >= deadline:
            rows.append({**ck, "ok": False, "detail": UNCHECKED})
            continue
        state = verify_checkpoint(ck["checkpoint_id"], deep=deep, deadline=deadline, return_state=True)
        ok = state.is_completed() and not state.result()["unchecked"]
        detail = "" if ok else UNCHECKED if state.is_completed() else state.message
        rows.append({**ck, "ok": ok, "detail": detail})
    if rows:
        create_table_artifact(
            key=artifact_key("rewind", run or "all", "scrub"), table=rows, description="Scrub results"
        )
    drift = check_catalog(run, rows=False)  # the other direction: copies on the tiers no row names
    if drift:
        get_run_logger().warning(
            "catalog and storage disagree in %d place(s): see the catalog-check artifact", len(drift)
        )
    shown = status_overview(run, return_state=True)  # where everything stands, after this scrub's verdicts
    if shown.is_failed():  # the overview is a view: its failure must not hide the scrub's verdict
        get_run_logger().warning("status overview not published: %s", shown.message)
    unchecked = [r for r in rows if r["detail"] == UNCHECKED]
    if unchecked:
        get_run_logger().warning(
            "scrub budget of %gs spent: %d of %d checkpoints not checked", budget_s, len(unchecked), len(rows)
        )
    bad = [r for r in rows if not r["ok"] and r["detail"] != UNCHECKED]
    if bad:
        raise RewindError(  # corrupt, or unverifiable right now: each row's detail says which
            f"{len(bad)} of {len(rows)} checkpoints failed verification: "
            + ", ".join(f"{r['run']}@{r['step']}" for r in bad)
        )
    return {
        "checked": len(rows) - len(unchecked),
        "unchecked": len(unchecked),
        "corrupt": 0,
        "drift": len(drift),
    }


@flow(name="restore-checkpoint")
def restore_checkpoint_flow(
    run: str,
    step: int | None = None,
    relaunch: bool = False,
    relaunch_command: list[str] | None = None,
    cwd: str | None = None,
) -> dict[str, Any] | State:
    """Roll a run back to a verified checkpoint; its next launch resumes from there.

    Args:
        run: Catalog name of the run.
        step: The step to go back to (default: the newest checkpoint that verifies).
        relaunch: Start the job again from the run's job spec and watch it.
        relaunch_command: Start it with this command instead (it replaces the command of the run's spec, the
            rest kept, once the roll-back is done).
        cwd: Working directory for `relaunch_command` (default: the run's spec's, else as protect-training's).
    """
    spec = None
    if relaunch or relaunch_command:  # no live job's checkpoints rolled back under it, no second job started
        refuse_live_writer(run)
    if relaunch_command:  # checked now, recorded once the roll-back is done: a failed one changes nothing
        refuse_secrets(relaunch_command, None)
        spec = relaunch_spec(run, relaunch_command, cwd)
    elif relaunch:
        spec = load_spec(run)  # before the roll-back: a run without a spec fails here, unchanged
    point = restore_checkpoint(
        run, step, roll_back=True, reason=f"rolled back to step {step} from the restore-checkpoint flow"
    )
    if relaunch_command and spec is not None:
        spec = record_spec(run, spec)
    chosen = point.as_dict()
    if spec is None:
        return chosen
    outcome = supervise_training(run, spec, {"restore": point.target.as_dict()})
    chosen["relaunch"] = outcome.how
    if not outcome.finished:
        chosen["incident_id"] = record_failure(outcome)
        why = f"rolled back to step {point.step}; the relaunch failed ({outcome.kind}, incident {chosen['incident_id']})"
        return failed(why, chosen)
    return chosen


@flow(name="replicate-offsite")
def replicate_offsite(
    target: str | None = None,
    run: str | None = None,
    keep_last: int | None = None,
    keep_every: int = 0,
    part_size_mib: int = 64,
    concurrency: int = 8,
) -> dict[str, Any]:
    """Copy every committed checkpoint without a verified copy there to S3 or a shared path, then apply retention.

    Args:
        target: s3://bucket/prefix, or an absolute path for a shared filesystem; default REWIND_OFFSITE_URI.
        run: Only this run (default: every run).
        keep_last: Retention: keep the newest N checkpoints per run (default REWIND_KEEP_LAST; unset: no deletion).
        keep_every: Retention: also keep every step divisible by K (default REWIND_KEEP_EVERY).
        part_size_mib: S3 multipart part size.
        concurrency: S3 parts in flight.
    """
    target = replicate.target_uri(target)
    policy = replicate.retention_policy(keep_last, keep_every)
    done = [
        replicate_checkpoint(ck_id, target, part_size_mib, concurrency)
        for ck_id in pending_replication(target, run)
    ]
    removed = apply_retention(run, policy.keep_last, policy.keep_every) if policy else {}
    return {
        "replicated": len(done),
        "bytes_sent": sum(d["bytes_sent"] for d in done),
        "bytes_reused": sum(d["bytes_reused"] for d in done),
        "removed": removed,
    }


@flow(name="adopt-checkpoints")
def adopt_checkpoints(
    path: str,
    run: str,
    pattern: str = "checkpoint-*",
    step: int | None = None,
    format: str | None = None,
    quiet_s: float = 60.0,
) -> dict[str, Any]:
    """Take checkpoints Rewind did not write under protection: verify, replicate, retain and restore them.

    Args:
        path: One checkpoint directory, or a directory whose sub-directories matching `pattern` are checkpoints
            (an HF Trainer output_dir, a TorchTitan `checkpoint/` folder).
        run: The run they belong to (created if new).
        pattern: Which sub-directories are checkpoints: `checkpoint-*` (HF Trainer), `step-*` (TorchTitan).
        step: The step, for a single directory whose name does not say it.
        format: dcp, torchtitan, hf-trainer or safetensors (default: detected from the files).
        quiet_s: A sub-directory is adopted once its writer's last file is there and nothing in it changed
            for this long (a checkpoint still being written is left for the next run).
    """
    found = find_unadopted(path, run, pattern, quiet_s)
    if step is not None and len(found) > 1:
        raise ConfigError(f"`step` names one checkpoint, but {path} holds {len(found)} to adopt")
    done = [adopt_checkpoint(p, run, step, format) for p in found]
    return {"adopted": [d["step"] for d in done if d["action"] == "adopted"], "checked": len(found)}


@flow(name="expire-conversations")
def expire_conversations_flow() -> dict[str, int]:
    """Delete conversations (history and KV-block names) past their TTL; runs on a schedule."""
    return {"expired": expire_conversations()}
