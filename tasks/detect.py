"""Phase 4, detect: supervise a training process, verify what it commits, turn a death into an incident."""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.catalog import incidents, lineage
from infra.catalog.models import CheckpointStatus
from infra.health import nvml
from infra.health.signals import Detection, Heartbeats, LossWatch
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
    heartbeat_timeout_s: float | None = None,
    loss_spike_factor: float | None = None,
    env: dict[str, str] | None = None,
    gpu_check_s: float | None = 30.0,
) -> dict[str, Any]:
    """Run the job to its end; verify each checkpoint as it is committed; report how it ended.

    With ``heartbeat_timeout_s``, ranks heartbeat through ``REWIND_HEARTBEAT_DIR``;
    a rank silent for longer is hung, and the job is stopped. A NaN/Inf loss (or,
    with ``loss_spike_factor``, a spike above that multiple of the running median)
    stops it too, and so does an unhealthy GPU (NVML, every ``gpu_check_s``, where
    a driver exists). ``env`` adds to the job's environment. When this is a
    relaunch (``incident_id`` given), the first training step after restore
    completes the incident's timings: relaunch seconds and RTO.
    """
    log = get_run_logger()
    cat = catalog()
    run_id = lineage.ensure_run(cat, run)
    seen = {c.id for c in lineage.checkpoints(cat, run) if c.status != CheckpointStatus.COMMITTED}
    launched = time.time()
    beats = Heartbeats(heartbeat_timeout_s) if heartbeat_timeout_s else None
    hb_dir = Path(tempfile.mkdtemp(prefix=f"rewind-heartbeats-{run[:40]}-")) if beats else None
    child_env = {**(env or {}), **({"REWIND_HEARTBEAT_DIR": str(hb_dir)} if hb_dir else {})}
    proc = TrainingProcess(command, cwd=cwd, env=child_env)
    hang: dict[str, Any] | None = None
    watch = LossWatch(spike_factor=loss_spike_factor or float("inf"))
    anomaly: Detection | None = None
    seen_lines = 0
    next_gpu_check = time.monotonic() + (gpu_check_s or 0)
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
        for line in proc.output.lines[seen_lines:]:
            m = STEP_LINE.match(line)
            if m and anomaly is None:
                anomaly = watch.observe(int(m.group(1)), float(m.group(2)))
        seen_lines = len(proc.output.lines)
        if gpu_check_s and anomaly is None and alive and time.monotonic() >= next_gpu_check:
            next_gpu_check = time.monotonic() + gpu_check_s
            try:
                sick = [g for g in nvml.probe() if not g.healthy]
            except nvml.NoNvidiaDriver as exc:
                log.info("%s: GPU health is not monitored", exc)
                gpu_check_s = None
                sick = []
            if sick:
                why = "; ".join(f"GPU {g.index} ({g.name}): {', '.join(g.problems)}" for g in sick)
                anomaly = Detection("gpu", None, proc.output.last_step, why)
        if anomaly is not None and alive:
            log.error("%s; stopping the job", anomaly.reason)
            proc.kill(signal.SIGTERM, timeout=60)
            alive = False
        if beats is not None and hb_dir is not None and alive and hang is None:
            hang = _check_heartbeats(beats, hb_dir)
            if hang is not None:
                log.error("hang detected: %s; stopping the job", hang["reason"])
                proc.kill(signal.SIGTERM, timeout=60)
                alive = False
        if not alive:
            break
    code = proc.finish()
    ended = time.time()
    if hb_dir is not None:
        shutil.rmtree(hb_dir, ignore_errors=True)
    outcome = {
        "kind": anomaly.kind if anomaly else "hang" if hang else "crash",
        "hang": hang,
        "bad_step": anomaly.step if anomaly else None,
        "anomaly": anomaly.reason if anomaly else None,
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


def _check_heartbeats(beats: Heartbeats, hb_dir: Path) -> dict[str, Any] | None:
    for f in hb_dir.glob("rank-*"):
        if f.suffix == ".tmp":
            continue
        try:
            hb = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        beats.beat(int(f.name.split("-")[1]), int(hb["step"]), float(hb["time"]))
    now = time.time()
    hung = beats.hung(now)
    if not hung:
        return None
    silent = max(now - beats.last[d.rank][0] for d in hung if d.rank is not None)
    return {
        "ranks": [d.rank for d in hung],
        "step": min(d.step or 0 for d in hung),
        "silent_s": silent,
        "timeout_s": beats.timeout_s,
        "reason": "; ".join(d.reason for d in hung),
    }


@task(name="record-failure", **RETRY)
def record_failure(outcome: dict[str, Any]) -> int:
    """One incident and one ``rewind.failure.detected`` event per abnormal end."""
    cat = catalog()
    run = outcome["run"]
    now = time.time()
    kind = outcome.get("kind", "crash")
    hang = outcome.get("hang")
    reason = outcome.get("anomaly") or (
        hang["reason"] if hang else f"training {outcome['how']} after step {outcome['last_step']}"
    )
    incident_id = incidents.open_incident(
        cat,
        run,
        kind,
        reason,
        # a hang is detected when a rank's silence passes its timeout: measured from its last heartbeat
        detection_s=hang["silent_s"] if hang else now - outcome["died_at"],
        details={
            "died_at": outcome["died_at"],
            "exit_code": outcome["exit_code"],
            "last_step": outcome["last_step"],
            "command": outcome["command"],
            "cwd": outcome["cwd"],
            "tail": outcome["tail"],
            "hang": hang,
            "bad_step": outcome.get("bad_step"),
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
            "kind": kind,
            "bad_step": outcome.get("bad_step"),
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
