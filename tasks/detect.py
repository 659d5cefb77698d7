"""Phase 4, detect: launch a run from its spec, watch it (infra.launch.supervisor), turn a failure into an incident."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.catalog import incidents, jobs, lineage
from infra.errors import Refused
from infra.health.signals import describe_exit
from infra.launch import observe
from infra.launch.observe import Observation, Seen, first_failure
from infra.launch.spec import JobSpec
from infra.launch.supervisor import Supervisor, redacted
from infra.training import progress
from tasks.common import INCIDENT_KIND_LABEL, RETRY, artifact_key, catalog, emit
from tasks.progress import TrainingView
from tasks.verify import verify_checkpoint

# The job ended by itself with an error before any rank got past the step it started from (an import
# error, a bad flag, a missing file): relaunching it would fail the same way, so nothing recovers it.
FAILED_TO_START = "failed_to_start"


@task(name="supervise-training", retries=0)
def supervise_training(
    run: str,
    spec: dict[str, Any],
    handoff: dict[str, Any] | None = None,
    incident_id: int | None = None,
    died_at: float | None = None,
    poll_s: float = 1.0,
    gpu_check_s: float | None = 30.0,
) -> dict[str, Any]:
    """Launch the run from ``spec`` and watch it to its end; verify each checkpoint as it is committed.

    A rank that stops advancing (``heartbeat_timeout_s`` in the spec), an anomaly a rank
    recorded, or a sick GPU stops the job; so does the first failed exit (a lost node's
    agent). When this is a relaunch (``incident_id``), the first step completes the
    incident's timings: relaunch seconds and RTO.
    """
    sup = Supervisor(
        catalog(),
        run,
        JobSpec.from_dict(spec),
        handoff=handoff,
        incident_id=incident_id,
        gpu_check_s=gpu_check_s,
    )
    launch_id = sup.start()
    get_run_logger().info(
        "launch %d of %s: %d node(s) x %d process(es)",
        launch_id,
        run,
        sup.spec.nnodes,
        sup.spec.nproc_per_node,
    )
    watch = _Watch(run, incident_id, died_at, sup.started_at)
    run_id = lineage.get_run(sup.cat, run).id
    verified = [c.step for c in lineage.restorable(sup.cat, run_id) if c.status == "verified"]
    watch.verified_step = verified[0] if verified else None  # a relaunch starts from what is proven already
    view = TrainingView(run)
    try:
        finished = False
        while not finished:
            finished = watch.done(sup.poll(poll_s), sup)
            try:
                view.show(sup.ranks, watch.verified_step)
            except Exception as exc:  # showing progress must never stop the job it shows
                get_run_logger().warning("training progress not shown: %s", exc)
    except BaseException:  # never leave a job running that nobody watches
        sup.stop(grace_s=10)
        raise
    return watch.outcome(sup, sup.finish(), launch_id)


class _Watch:
    """What the supervising task makes of each observation."""

    def __init__(self, run: str, incident_id: int | None, died_at: float | None, launched: float) -> None:
        self.run, self.incident_id, self.died_at, self.launched = run, incident_id, died_at, launched
        self.stop: Observation | None = None  # what made Rewind stop the job (hang, anomaly, gpu)
        self.exits: list[Observation] = []
        self.first_step_at: float | None = None
        self.stopped = False
        self.verified_step: int | None = None

    def done(self, seen: list[Observation], sup: Supervisor) -> bool:
        for o in seen:
            if o.kind is Seen.COMMITTED:
                self._committed(o)
            elif o.kind is Seen.FIRST_STEP and self.first_step_at is None:
                self._first_step(o)
            elif o.kind in (Seen.HANG, Seen.ANOMALY, Seen.GPU) and self.stop is None:
                self.stop = o
                get_run_logger().error("%s: %s; stopping the job", o.kind.value, o.detail.get("reason"))
            elif o.kind is Seen.EXITED and all(e.detail["node"] != o.detail["node"] for e in self.exits):
                self.exits.append(o)
        if not self.stopped and (self.stop is not None or first_failure(self.exits) is not None):
            self.stopped = True
            sup.stop()
        return len(self.exits) == len(sup.processes)

    def _committed(self, o: Observation) -> None:
        ck_id = o.detail["checkpoint_id"]
        payload = {"step": o.step, "checkpoint_id": ck_id}
        emit("rewind.checkpoint.committed", self.run, payload, step=o.step, checkpoint_id=ck_id)
        state = verify_checkpoint(ck_id, deep=True, return_state=True)
        if state.is_failed():
            get_run_logger().error("checkpoint step %s failed verification: %s", o.step, state.message)
        elif o.step is not None:
            self.verified_step = max(o.step, self.verified_step or 0)

    def _first_step(self, o: Observation) -> None:
        self.first_step_at = o.at
        if self.incident_id is None:
            return
        fields: dict[str, Any] = {"rebuild_s": o.at - self.launched}
        if self.died_at is not None:
            fields["rto_s"] = o.at - self.died_at
        details = {"first_step_after_restore_at": o.at, "resumed_at_step": o.detail.get("from_step")}
        incidents.update_incident(catalog(), self.incident_id, details=details, **fields)

    def _kind(self, code: int, started: bool) -> str:
        if self.stop is not None:
            return str(self.stop.detail.get("kind", self.stop.kind.value))
        if code > 0 and not started:  # the job's own failure (not a signal) before its first step
            return FAILED_TO_START
        return "crash"

    def outcome(self, sup: Supervisor, code: int, launch_id: int) -> dict[str, Any]:
        ranks = progress.read(catalog(), launch_id)
        # read again: a step reported just before the exit may not have been polled
        started = self.first_step_at is not None or observe.first_step(ranks) is not None
        failed = first_failure(self.exits)
        stop = self.stop
        ended = stop or failed  # Rewind's own stop comes after what it saw
        killed = (
            failed is not None and failed.detail["exit_code"] < 0 and sup.spec.nnodes > 1 and stop is None
        )
        out = {
            "kind": self._kind(code, started),
            "hang": stop.detail if stop is not None and stop.kind is Seen.HANG else None,
            "bad_step": stop.step if stop is not None and stop.kind is Seen.ANOMALY else None,
            "anomaly": stop.detail.get("reason") if stop is not None else None,
            "anomaly_position": stop.detail.get("position") if stop is not None else None,
            "run": self.run,
            "launch_id": launch_id,
            "spec": redacted(sup.spec),
            "lost_node": failed.detail["node"]
            if killed and failed is not None
            else None,  # a node, not a rank
            "exit_code": code,
            "how": describe_exit(code),
            "died_at": ended.at if ended is not None else time.time(),
            "last_step": max((r.step for r in ranks if r.step is not None), default=None),
            "first_step_at": self.first_step_at,
            "tail": sup.tail(),
        }
        get_run_logger().info(
            "launch %d of %s %s after step %s", launch_id, self.run, out["how"], out["last_step"]
        )
        return out


@task(name="record-spec", **RETRY)
def record_spec(run: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Keep how the run is launched in the catalog; recovery relaunches from it. Returns it, checked."""
    checked = JobSpec.from_dict(spec).as_dict()
    jobs.set_spec(catalog(), run, checked)
    return checked


@task(name="load-spec", **RETRY)
def load_spec(run: str) -> dict[str, Any]:
    return jobs.get_spec(catalog(), run)


def _crash_reason(outcome: dict[str, Any]) -> str:
    if outcome.get("kind") == FAILED_TO_START:
        last = next((line for line in reversed(outcome["tail"]) if line.strip()), None)
        return (
            f"training failed to start: it {outcome['how']} before its first step; not recovered "
            "automatically (a relaunch would fail the same way): fix the job and start it again"
            + (f"; its last line: {last.strip()}" if last else "; it printed nothing")
        )
    where = f"node {outcome['lost_node']} lost: " if outcome.get("lost_node") is not None else ""
    if outcome["last_step"] is None:
        return f"{where}training {outcome['how']}; it reported no step (not using the session API?)"
    return f"{where}training {outcome['how']} after step {outcome['last_step']}"


@task(name="record-failure", **RETRY)
def record_failure(outcome: dict[str, Any]) -> int:
    """One incident and one ``rewind.failure.detected`` event per abnormal end, however often retried."""
    cat = catalog()
    run = outcome["run"]
    now = time.time()
    kind = outcome.get("kind", "crash")
    hang = outcome.get("hang")
    reason = outcome.get("anomaly") or (hang["reason"] if hang else _crash_reason(outcome))
    incident_id = incidents.open_incident(
        cat,
        run,
        kind,
        reason,
        origin=f"launch:{outcome['launch_id']}" if outcome.get("launch_id") is not None else None,
        # a hang is detected when a rank's silence passes its timeout: measured from its last heartbeat
        detection_s=hang["silent_s"] if hang else now - outcome["died_at"],
        details={
            "died_at": outcome["died_at"],
            "exit_code": outcome["exit_code"],
            "last_step": outcome["last_step"],
            "launch_id": outcome["launch_id"],
            "spec": outcome["spec"],
            "lost_node": outcome.get("lost_node"),
            "tail": outcome["tail"],
            "hang": hang,
            "bad_step": outcome.get("bad_step"),
            "anomaly_position": outcome.get("anomaly_position"),
        },
    )
    died = datetime.fromtimestamp(outcome["died_at"], UTC).isoformat(timespec="milliseconds")
    tail = "\n".join(outcome["tail"])
    get_run_logger().error(
        "incident %d on %s (%s): %s\nthe job's last lines:\n%s",
        incident_id,
        run,
        kind,
        reason,
        tail or "(none)",
    )
    create_markdown_artifact(
        key=artifact_key("rewind", run, "incident"),
        markdown=(
            f"# Incident {incident_id} on `{run}` ({kind})\n\n{reason}.\n\nTraining {outcome['how']} at "
            f"{died} after step {outcome['last_step']}. Its last lines:\n\n```\n" + tail + "\n```\n"
        ),
    )
    if incidents.announced(cat, incident_id):  # a retry of this task after the event went out
        return incident_id
    emit(
        "rewind.failure.detected",
        run,
        {
            "incident_id": incident_id,
            "kind": kind,
            "reason": reason,
            "bad_step": outcome.get("bad_step"),
            "exit_code": outcome["exit_code"],
            "last_step": outcome["last_step"],
            "died_at": outcome["died_at"],
            "launch_id": outcome["launch_id"],
            "tail": outcome["tail"],
        },
        labels={INCIDENT_KIND_LABEL: kind},  # the recovery trigger leaves failed_to_start alone
    )
    incidents.mark_announced(cat, incident_id)
    return incident_id


@task(name="claim-recovery", **RETRY)
def claim_recovery(incident_id: int) -> str | None:
    """Make this flow run the one recovery of the incident; the flow run that already holds it, if another.

    A failure event delivered twice (or a recovery started by hand beside the automatic one)
    must not relaunch the job twice.
    """
    from prefect.runtime import flow_run

    me = f"flow-run:{flow_run.id or 'local'}"
    holder = incidents.claim_recovery(catalog(), incident_id, me)
    return None if holder == me else holder


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
        raise Refused(
            f"run {run!r} had {n} incidents in the last {window_s:.0f}s (limit {max_incidents}); not recovering automatically"
        )
    return n
