"""Phase 4, detect: supervise a training process, verify what it commits, turn a death into an incident."""

from __future__ import annotations

import shlex
import signal
import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.catalog import incidents, lineage
from infra.catalog.models import CheckpointStatus
from infra.launch.process import STEP_LINE, TrainingProcess
from tasks.common import RETRY, artifact_key, catalog, emit
from tasks.verify import verify_checkpoint


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@task(name="supervise-training", retries=0)
def supervise_training(
    run: str,
    command: list[str],
    cwd: str | None = None,
    incident_id: int | None = None,
    died_at: float | None = None,
    poll_s: float = 1.0,
) -> dict[str, Any]:
    """Run the job to its end; verify each checkpoint as it is committed; report how it ended.

    When this is a relaunch (``incident_id`` given), the first training step
    after restore completes the incident's timings: relaunch seconds and RTO.
    """
    log = get_run_logger()
    cat = catalog()
    run_id = lineage.ensure_run(cat, run)
    seen = {c.id for c in lineage.checkpoints(cat, run) if c.status != CheckpointStatus.COMMITTED}
    launched = time.time()
    proc = TrainingProcess(command, cwd=cwd)
    log.info("launched pid %d: %s", proc.pid, shlex.join(command))
    first_step_at: float | None = None
    last_check = 0.0
    while True:
        try:
            alive = proc.wait_for(lambda line: STEP_LINE.match(line) is not None, timeout=poll_s)
        except TimeoutError:
            alive = True
        if first_step_at is None and proc.output.losses:
            first_step_at = time.time()
            if incident_id is not None:
                restored = proc.output.resumed_at or 0
                fields: dict[str, Any] = {"rebuild_s": first_step_at - launched}
                details: dict[str, Any] = {
                    "first_step_after_restore_at": first_step_at,
                    "resumed_at_step": restored,
                }
                if died_at is not None:
                    fields["rto_s"] = first_step_at - died_at
                incidents.update_incident(cat, incident_id, details=details, **fields)
        if not alive or time.monotonic() - last_check >= poll_s:
            last_check = time.monotonic()
            for ck in lineage.restorable(cat, run_id):
                if ck.id in seen or ck.status != CheckpointStatus.COMMITTED:
                    continue
                seen.add(ck.id)
                emit(
                    "rewind.checkpoint.committed",
                    run,
                    {"step": ck.step, "checkpoint_id": ck.id},
                    step=ck.step,
                    checkpoint_id=ck.id,
                )
                state = verify_checkpoint(ck.id, deep=True, return_state=True)
                if state.is_failed():
                    log.error("checkpoint step %d failed verification: %s", ck.step, state.message)
        if not alive:
            break
    code = proc.finish()
    ended = time.time()
    outcome = {
        "run": run,
        "command": command,
        "cwd": cwd,
        "pid": proc.pid,
        "exit_code": code,
        "how": _describe_exit(code),
        "died_at": ended,
        "last_step": proc.output.last_step,
        "resumed_at": proc.output.resumed_at,
        "first_step_at": first_step_at,
        "tail": proc.output.lines[-20:],
    }
    log.info("training %s after step %s", outcome["how"], outcome["last_step"])
    return outcome


@task(name="record-failure", **RETRY)
def record_failure(outcome: dict[str, Any]) -> int:
    """One incident and one ``rewind.failure.detected`` event per abnormal end."""
    cat = catalog()
    run = outcome["run"]
    now = time.time()
    incident_id = incidents.open_incident(
        cat,
        run,
        "crash",
        f"training {outcome['how']} after step {outcome['last_step']}",
        detection_s=now - outcome["died_at"],
        details={
            "died_at": outcome["died_at"],
            "exit_code": outcome["exit_code"],
            "last_step": outcome["last_step"],
            "command": outcome["command"],
            "cwd": outcome["cwd"],
            "tail": outcome["tail"],
        },
    )
    died = datetime.fromtimestamp(outcome["died_at"], UTC).isoformat(timespec="milliseconds")
    create_markdown_artifact(
        key=artifact_key("rewind", run, "incident"),
        markdown=(
            f"# Incident {incident_id} on `{run}`\n\nTraining {outcome['how']} at {died} after step "
            f"{outcome['last_step']}.\n\n```\n" + "\n".join(outcome["tail"]) + "\n```\n"
        ),
    )
    emit(
        "rewind.failure.detected",
        run,
        {
            "incident_id": incident_id,
            "kind": "crash",
            "exit_code": outcome["exit_code"],
            "last_step": outcome["last_step"],
            "died_at": outcome["died_at"],
            "command": outcome["command"],
            "cwd": outcome["cwd"],
        },
    )
    return incident_id


@task(name="load-incident", **RETRY)
def load_incident(incident_id: int) -> dict[str, Any]:
    inc = incidents.get_incident(catalog(), incident_id)
    run = lineage.get_run_by_id(catalog(), inc.run_id).name
    return {
        "id": inc.id,
        "run": run,
        "kind": inc.kind,
        "reason": inc.reason,
        "details": dict(inc.details or {}),
    }


@task(name="annotate-incident", **RETRY)
def annotate_incident(
    incident_id: int, details: dict[str, Any] | None = None, resolved: bool = False, **fields: Any
) -> None:
    """Record timings and decisions on an incident as recovery proceeds."""
    cat = catalog()
    incidents.update_incident(cat, incident_id, details=details, **fields)
    if resolved:
        incidents.resolve(cat, incident_id)


@task(name="check-recovery-budget", **RETRY)
def check_recovery_budget(run: str, max_incidents: int, window_s: float) -> int:
    """Refuse an endless crash loop: too many incidents in the window stops automatic recovery."""
    n = incidents.recent_count(catalog(), run, window_s)
    if n > max_incidents:
        raise RuntimeError(
            f"run {run!r} had {n} incidents in the last {window_s:.0f}s (limit {max_incidents}); not recovering automatically"
        )
    return n
