"""Phase 4, detect: launch a run from its spec, watch it to its end, and turn a failure into an incident.

``supervise`` starts the job (``launch.supervisor``) and watches it: a rank that stops
advancing, an anomaly a rank recorded, or a sick GPU stops the job; so does the first
failed exit. Each checkpoint the job commits is announced and handed to ``verify``
(the caller's: the verify phase, or its Prefect task). The launch ends as an
``Outcome``; ``record_failure`` makes one incident and one ``rewind.failure.detected``
event of an outcome that is not ``finished``, however often it is retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rewind.infra.catalog import incidents, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import IncidentKind
from rewind.infra.errors import TransientError
from rewind.infra.health import nvml
from rewind.infra.health.nvml import GpuHealth
from rewind.infra.health.signals import describe_exit
from rewind.infra.launch import observe
from rewind.infra.launch.detection import Detection, last_progress
from rewind.infra.launch.observe import Observation, Seen, first_failure
from rewind.infra.launch.spec import JobSpec, redacted
from rewind.infra.launch.supervisor import Supervisor
from rewind.infra.phases.beside import BesideVerifier, Verified
from rewind.infra.phases.first_step import first_step_after_restore
from rewind.infra.phases.notify import INCIDENT_KIND_LABEL, Notifier, artifact_key, run_event
from rewind.infra.training import progress
from rewind.infra.training.progress import RankState

# FAILED_TO_START: the job ended by itself with an error before any rank got past the step it started
# from (an import error, a bad flag, a missing file): relaunching it would fail the same way, so nothing
# recovers it. FINISHED: it exited 0 and nothing stopped it: no incident.
K = IncidentKind
_KINDS = frozenset(k.value for k in IncidentKind)

Verify = Callable[[int], bool]  # checkpoint id -> proven; the supervisor keeps watching either way
Show = Callable[[list[RankState], "int | None"], None]  # the ranks' progress and the newest verified step


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one launch ended, as the supervisor saw it."""

    run: str
    launch_id: int
    kind: IncidentKind
    exit_code: int
    how: str  # "exited with code 0", "was killed by SIGKILL", ...
    died_at: float  # when it ended (or when what made Rewind stop it was seen)
    last_step: int | None
    first_step_at: float | None
    spec: Mapping[str, Any]
    tail: tuple[str, ...]  # the job's last lines
    hang: Mapping[str, Any] | None = None
    bad_step: int | None = None
    anomaly: str | None = None
    anomaly_position: int | None = None
    lost_node: int | None = None  # a node, not a rank
    lost_hosts: tuple[str, ...] = ()  # the hosts the scheduler reported gone during the launch
    hosts: tuple[str, ...] = ()  # where the launch's nodes ran, node 0 first
    verified_step: int | None = field(default=None)
    restore_failed: str | None = None  # the job could not load its restore point: why
    group_failed: str | None = None  # the launch's process group failed its smoke test: why
    log_dir: str | None = None  # where the launch's whole output is kept (``joblog``), one file per node
    sick_gpus: tuple[int, ...] = ()  # NVML indices of the GPUs found unhealthy, when a GPU stopped the job
    gpus: tuple[int, ...] = ()  # every GPU NVML saw then
    detection: Mapping[str, Any] | None = None  # when each signal told of the failure (``Detection``)

    @property
    def finished(self) -> bool:
        return self.kind == K.FINISHED


def supervise(
    cat: Catalog,
    *,
    run: str,
    spec: JobSpec,
    notify: Notifier,
    verify: Verify,
    show: Show | None = None,
    handoff: Mapping[str, Any] | None = None,
    incident_id: int | None = None,
    died_at: float | None = None,
    poll_s: float = 1.0,
    gpu_check_s: float | None = 30.0,
    gpus: Callable[[], list[GpuHealth]] | None = None,
) -> Outcome:
    """Launch the run from ``spec`` and watch it to its end. When this is a relaunch (``incident_id``),
    the first step completes the incident's timings: relaunch seconds and RTO."""
    sup = Supervisor(
        cat, run, spec, handoff=dict(handoff or {}), incident_id=incident_id, gpu_check_s=gpu_check_s,
        gpus=gpus or nvml.probe,
    )  # fmt: skip
    launch_id = sup.start()
    notify.log(
        logging.INFO,
        "launch %d of %s: %d node(s) x %d process(es); its output is kept in %s (rewind logs %s)",
        launch_id,
        run,
        spec.nnodes,
        spec.nproc_per_node,
        sup.log_dir,
        run,
    )
    watch = _Watch(cat, run, notify, verify, incident_id, died_at, sup.started_at)
    verified = [
        c.step for c in lineage.restorable(cat, lineage.get_run(cat, run).id) if c.status == "verified"
    ]
    watch.verified_step = verified[0] if verified else None  # a relaunch starts from what is proven already
    try:
        finished = False
        while not finished:
            finished = watch.done(sup.poll(poll_s), sup)
            _show(show, sup, watch, notify)
    except BaseException:  # never leave a job running that nobody watches
        sup.stop(grace_s=10)
        raise
    out = watch.outcome(sup, sup.finish(), launch_id)
    _show(show, sup, watch, notify)  # the verifications the launch's end waited for: shown too
    return out


def _show(show: Show | None, sup: Supervisor, watch: _Watch, notify: Notifier) -> None:
    if show is None:
        return
    try:
        show(sup.ranks, watch.verified_step)
    except Exception as exc:  # showing progress must never stop the job it shows
        notify.log(logging.WARNING, "training progress not shown: %s", exc)


class _Watch:
    """What the supervising phase makes of each observation."""

    def __init__(
        self,
        cat: Catalog,
        run: str,
        notify: Notifier,
        verify: Verify,
        incident_id: int | None,
        died_at: float | None,
        launched: float,
    ) -> None:
        self.cat, self.run, self.notify, self.verify = cat, run, notify, verify
        self.incident_id, self.died_at, self.launched = incident_id, died_at, launched
        self.stop: Observation | None = None  # what made Rewind stop the job (hang, anomaly, gpu)
        self.exits: list[Observation] = []
        self.first_step_at: float | None = None
        self.stopped = False
        self.verified_step: int | None = None
        self.beside = BesideVerifier(verify)

    def done(self, seen: list[Observation], sup: Supervisor) -> bool:
        self._proven(self.beside.results())
        for o in seen:
            if o.kind is Seen.COMMITTED:
                self._committed(o)
            elif o.kind is Seen.FIRST_STEP and self.first_step_at is None:
                self._first_step(o)
            elif o.kind in (Seen.HANG, Seen.ANOMALY, Seen.GPU, Seen.HOST_LOST) and self.stop is None:
                self.stop = o
                self.notify.log(
                    logging.ERROR, "%s: %s; stopping the job", o.kind.value, o.detail.get("reason")
                )
            elif o.kind is Seen.EXITED and all(e.detail["node"] != o.detail["node"] for e in self.exits):
                self.exits.append(o)
        if not self.stopped and (self.stop is not None or first_failure(self.exits) is not None):
            self.stopped = True
            sup.stop()
        return len(self.exits) == len(sup.processes)

    def _committed(self, o: Observation) -> None:
        ck_id = o.detail["checkpoint_id"]
        payload = {"step": o.step, "checkpoint_id": ck_id}
        self.notify.event(
            run_event("rewind.checkpoint.committed", self.run, payload, step=o.step, checkpoint_id=ck_id)
        )
        self.beside.submit(ck_id, o.step)  # verified beside the watch: an exit or a hang is not kept waiting

    def _proven(self, finished: list[Verified]) -> None:
        for v in finished:
            if v.proven and v.step is not None:
                self.verified_step = max(v.step, self.verified_step or 0)

    def _first_step(self, o: Observation) -> None:
        self.first_step_at = o.at
        if self.incident_id is None:
            return
        try:
            first_step_after_restore(
                self.cat, incident_id=self.incident_id, observed=o, launched=self.launched,
                died_at=self.died_at, notify=self.notify,
            )  # fmt: skip
        except TransientError as exc:  # the timings are lost, the job is not: keep watching it
            self.notify.log(
                logging.WARNING, "incident %d: the first step not recorded: %s", self.incident_id, exc
            )

    def _kind(
        self, code: int, started: bool, restore: Mapping[str, Any] | None, group: Mapping[str, Any] | None
    ) -> IncidentKind:
        if group is not None:  # the rebuilt topology failed, not the job: worth a relaunch
            return K.CRASH
        if restore is not None:  # a failed restore: worth another recovery only if retrying may help
            return K.CRASH if restore.get("transient") else K.FAILED_TO_START
        if self.stop is not None:
            seen = str(self.stop.detail.get("kind", self.stop.kind.value))  # a rank's own word for it
            return IncidentKind(seen) if seen in _KINDS else K.CRASH
        if code > 0 and not started:  # the job's own failure (not a signal) before its first step
            return K.FAILED_TO_START
        return K.FINISHED if code == 0 else K.CRASH

    def _detection(self, sup: Supervisor, ranks: list[progress.RankState]) -> Detection:
        """When each signal was seen: exits before Rewind's own stop, the scheduler, the heartbeat."""
        stop_at = self.stop.at if self.stop is not None else None
        failed = [
            e.at for e in self.exits if e.detail["exit_code"] != 0 and (stop_at is None or e.at <= stop_at)
        ]
        hang = self.stop is not None and self.stop.kind is Seen.HANG
        return Detection(
            last_progress(ranks, sup.lost_hosts), min(failed, default=None), min(sup.lost_at.values(), default=None),
            self.stop.at if hang and self.stop is not None else None,
        )  # fmt: skip

    @staticmethod
    def _died_at(sup: Supervisor, ended: Observation | None, seen: Detection) -> float:
        """When the job failed: when its end (or what stopped it) was seen, or, for a lost host, when that
        host last made progress (a scheduler's word comes seconds later: detection is part of the RTO)."""
        at = ended.at if ended is not None else time.time()
        if sup.lost_hosts and seen.last_progress_at is not None:
            return min(at, seen.last_progress_at)
        return at

    @staticmethod
    def _lost_node(sup: Supervisor, failed: Observation | None, stop: Observation | None) -> int | None:
        """The node taken for lost: the first host the scheduler reported gone (its word beats an exit
        code), else the node of a multi-node job whose agent a signal killed (not Rewind's stop)."""
        if sup.lost_hosts:
            return min(sup.lost_hosts.values())
        if failed is not None and failed.detail["exit_code"] < 0 and sup.spec.nnodes > 1 and stop is None:
            return int(failed.detail["node"])
        return None

    def outcome(self, sup: Supervisor, code: int, launch_id: int) -> Outcome:
        if self.beside.pending:
            self.notify.log(
                logging.INFO, "waiting for %d checkpoint verification(s) to finish", self.beside.pending
            )
        self._proven(
            self.beside.join()
        )  # the launch is over; what it committed is judged before it is reported
        ranks = sup.ranks = progress.read(self.cat, launch_id)
        # read again: a step reported just before the exit may not have been polled
        started = self.first_step_at is not None or observe.first_step(ranks) is not None
        failed, stop = first_failure(self.exits), self.stop
        ended = stop or failed  # Rewind's own stop comes after what it saw
        anomaly = stop is not None and stop.kind is Seen.ANOMALY
        restore = next((r.detail["restore_failed"] for r in ranks if r.detail.get("restore_failed")), None)
        broken = [r for r in ranks if r.detail.get("group_failed")]  # the first to fail is the cause
        group = min(broken, key=lambda r: r.beat_at).detail["group_failed"] if broken else None
        seen = self._detection(sup, ranks)
        gpu = stop if stop is not None and stop.kind is Seen.GPU else None
        out = Outcome(
            run=self.run,
            launch_id=launch_id,
            kind=self._kind(code, started, restore, group),
            exit_code=code,
            how=describe_exit(code),
            died_at=self._died_at(sup, ended, seen),
            last_step=max((r.step for r in ranks if r.step is not None), default=None),
            first_step_at=self.first_step_at,
            spec=redacted(sup.spec),
            tail=tuple(sup.tail()),
            hang=stop.detail if stop is not None and stop.kind is Seen.HANG else None,
            bad_step=stop.step if anomaly and stop is not None else None,
            anomaly=stop.detail.get("reason") if stop is not None else None,
            anomaly_position=stop.detail.get("position") if stop is not None else None,
            lost_node=self._lost_node(sup, failed, stop),
            lost_hosts=tuple(sorted(sup.lost_hosts)),
            hosts=sup.placement.hosts if sup.placement is not None else (),
            log_dir=str(sup.log_dir) if sup.log_dir else None,
            sick_gpus=tuple(gpu.detail.get("sick_gpus") or ()) if gpu is not None else (),
            gpus=tuple(gpu.detail.get("gpus") or ()) if gpu is not None else (),
            verified_step=self.verified_step,
            restore_failed=str(restore["reason"]) if restore is not None else None,
            group_failed=str(group["reason"]) if group is not None else None,
            detection=seen.as_dict() if code != 0 or stop is not None else None,
        )
        self.notify.log(
            logging.INFO,
            "launch %d of %s %s %s",
            launch_id,
            self.run,
            out.how,
            f"after step {out.last_step}" if out.last_step is not None else "before its first step",
        )
        return out


def crash_reason(outcome: Outcome) -> str:
    """One line a person reads: what ended the job, and where."""
    if outcome.group_failed:
        return f"the rebuild failed: {outcome.group_failed}"
    if outcome.restore_failed:
        return f"the job could not load its restore point ({outcome.how} before its first step): {outcome.restore_failed}"
    if outcome.anomaly:
        return outcome.anomaly
    if outcome.hang:
        return str(outcome.hang["reason"])
    if outcome.kind == K.FAILED_TO_START:
        last = next((line for line in reversed(outcome.tail) if line.strip()), None)
        return (
            f"training failed to start: it {outcome.how} before its first step; not recovered "
            "automatically (a relaunch would fail the same way): fix the job and start it again"
            + (f"; its last line: {last.strip()}" if last else "; it printed nothing")
        )
    where = f"node {outcome.lost_node} lost: " if outcome.lost_node is not None else ""
    if outcome.lost_hosts:
        where = f"host {', '.join(outcome.lost_hosts)} lost (node {outcome.lost_node}): "
    if outcome.last_step is None:
        return f"{where}training {outcome.how}; it reported no step (not using the session API?)"
    return f"{where}training {outcome.how}; its last reported step was {outcome.last_step}"


def record_failure(cat: Catalog, *, outcome: Outcome, notify: Notifier) -> int:
    """One incident and one ``rewind.failure.detected`` event per abnormal end, however often retried."""
    now, reason = time.time(), crash_reason(outcome)
    incident_id = incidents.open_incident(
        cat,
        outcome.run,
        outcome.kind,
        reason,
        origin=f"launch:{outcome.launch_id}",
        # a hang is detected when a rank's silence passes its timeout: measured from its last heartbeat
        detection_s=outcome.hang["silent_s"] if outcome.hang else now - outcome.died_at,
        details={
            "died_at": outcome.died_at, "exit_code": outcome.exit_code, "last_step": outcome.last_step,
            "launch_id": outcome.launch_id, "spec": dict(outcome.spec), "lost_node": outcome.lost_node,
            "lost_hosts": list(outcome.lost_hosts), "hosts": list(outcome.hosts),
            "tail": list(outcome.tail), "hang": outcome.hang, "bad_step": outcome.bad_step,
            "anomaly_position": outcome.anomaly_position,
            "failed_phase": "rebuild" if outcome.group_failed else None, "log_dir": outcome.log_dir,
            "sick_gpus": list(outcome.sick_gpus), "gpus": list(outcome.gpus),
            "detection": dict(outcome.detection) if outcome.detection else None,
        },
    )  # fmt: skip
    _report(notify, incident_id, outcome, reason)
    if incidents.announced(cat, incident_id):  # a retry after the event went out
        return incident_id
    payload = {
        "incident_id": incident_id, "kind": outcome.kind, "reason": reason, "bad_step": outcome.bad_step,
        "exit_code": outcome.exit_code, "last_step": outcome.last_step, "died_at": outcome.died_at,
        "launch_id": outcome.launch_id, "tail": list(outcome.tail),
    }  # fmt: skip
    # the label lets the recovery trigger leave failed_to_start alone
    event = run_event(
        "rewind.failure.detected", outcome.run, payload, labels={INCIDENT_KIND_LABEL: outcome.kind}
    )
    notify.event(event)
    incidents.mark_announced(cat, incident_id)
    return incident_id


def _report(notify: Notifier, incident_id: int, outcome: Outcome, reason: str) -> None:
    died = datetime.fromtimestamp(outcome.died_at, UTC).isoformat(timespec="milliseconds")
    tail = "\n".join(outcome.tail)
    when = "before its first step" if outcome.last_step is None else f"after step {outcome.last_step}"
    kept = (
        f"\nIts whole output: `{outcome.log_dir}` (`rewind logs {outcome.run}`).\n" if outcome.log_dir else ""
    )
    notify.log(
        logging.ERROR,
        "incident %d on %s (%s): %s\nthe job's last lines:\n%s",
        incident_id, outcome.run, outcome.kind, reason, tail or "(none)",
    )  # fmt: skip
    notify.markdown(
        key=artifact_key("rewind", outcome.run, "incident"),
        text=(
            f"# Incident {incident_id} on `{outcome.run}` ({outcome.kind})\n\n{reason}.\n\nTraining {outcome.how} at "
            f"{died} {when}. Its last lines:\n\n```\n" + tail + "\n```\n" + kept
        ),
    )
