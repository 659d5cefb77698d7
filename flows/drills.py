"""Recovery drills: Chaos Toolkit experiments run by chaostoolkit-lib against a real job under Rewind's flows.

The experiment's actions that hurt the job live in ``rewind.infra.drills.chaos`` (no Prefect); the ones here
start the job under ``protect-training``, wait for the failure and run ``recover-training``, exactly as
the automation would. Each drill is recorded in the catalog (``drill`` table) with its phases, RTO, RPO,
post-recovery loss curve against an uninterrupted reference run, and the phase that broke its SLO.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from rewind.infra.catalog import drills as drill_rows
from rewind.infra.catalog import incidents
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import chaos, experiments, measure, slo
from rewind.infra.drills import job as drill_job
from rewind.infra.errors import ConfigError, NotFoundError, RewindError
from rewind.infra.launch.spec import JobSpec

_ACTIVE: dict[str, dict[str, Any]] = {}  # run -> the protect thread, its result, recovery's result


# -- actions named by the experiments --------------------------------------------------------------


def _prefect_of(configuration: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """The drill's own Prefect server for the flows run in this thread, where the drill started one."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    api = chaos.own_prefect_api(configuration)
    return temporary_settings(updates={PREFECT_API_URL: api}) if api else contextlib.nullcontext()


def start_protected(configuration: dict[str, Any]) -> str:
    """Start the drill's job under protect-training (in a thread: the next actions hurt it meanwhile)."""
    from rewind.flows.training import protect_training, summary

    run, state = configuration["run"], Path(configuration["state_dir"])
    j = drill_job.job_of(configuration)
    out, log = state / "out", state / "loss.jsonl"
    cmd = drill_job.command(configuration, run, out, log)
    slot: dict[str, Any] = {"result": None, "error": None}
    hang_s = float(j["heartbeat_timeout_s"]) if j.get("heartbeat_timeout_s") else None
    spec = configuration.get("job_spec")
    if spec:  # the user's job, as the spec says; a scenario's hang timeout where the spec sets none
        kw: dict[str, Any] = {
            "cwd": spec["cwd"], "env": {k: drill_job.fill(v, run, out, log) for k, v in spec["env"].items()},
            "nproc_per_node": spec["nproc_per_node"], "nnodes": spec["nnodes"],
            "min_world_size": spec["min_world_size"], "heartbeat_timeout_s": spec["heartbeat_timeout_s"] or hang_s,
            "loss_spike_factor": spec["loss_spike_factor"], "global_batch": spec["global_batch"], "lr": spec["lr"],
            **(spec.get("layout") or {}),
        }  # fmt: skip
    else:
        # the drill's own directory: never one whose folders a job's imports could pick up by accident
        kw = {"cwd": str(state), "env": {"OMP_NUM_THREADS": "1"}, "heartbeat_timeout_s": hang_s}
        kw.update({k: j[k] for k in ("nnodes", "nproc_per_node", "launcher") if j.get(k)})

    def go() -> None:
        try:
            with _prefect_of(configuration):
                slot["result"] = summary(protect_training(run, cmd, **kw, return_state=True))
        except BaseException as exc:
            slot["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=go, name=f"drill-protect-{run}", daemon=True)
    slot["thread"] = t
    _ACTIVE[run] = slot
    t.start()
    return run


def _ended(configuration: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """What protect-training returned, once it ended (bounded)."""
    slot = _ACTIVE[configuration["run"]]
    slot["thread"].join(timeout=timeout_s)
    if slot["thread"].is_alive():
        raise RewindError(f"protect-training of {configuration['run']} did not end within {timeout_s:g}s")
    if slot["error"]:
        raise RewindError(f"protect-training failed: {slot['error']}")
    return dict(slot["result"])


def await_failure(configuration: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """Wait (bounded) for protect-training to end; the job must have failed (an incident)."""
    result = _ended(configuration, timeout_s)
    if not result.get("incident_id"):
        raise RewindError(f"the fault did not stop the job: {result}")
    return result


def await_end(configuration: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """Wait (bounded) for protect-training to end; a job that failed is recovered, one that finished is left."""
    result = _ended(configuration, timeout_s)
    if result.get("incident_id"):
        return {"ended": result, "recovery": recover(configuration)}
    return {"ended": result}


def recover(configuration: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Run recover-training on the drill's incident, as the failure event's automation would."""
    from rewind.flows.training import recover_training, summary

    slot = _ACTIVE.get(configuration["run"]) or {}
    incident_id = (slot.get("result") or {}).get("incident_id")
    if incident_id is None:
        raise RewindError("no incident to recover: the job did not fail as the experiment meant it to")
    done: dict[str, Any] = {}

    def go() -> None:
        try:
            with _prefect_of(configuration):
                done["result"] = summary(recover_training(incident_id, return_state=True))
        except BaseException as exc:
            done["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=go, name=f"drill-recover-{incident_id}", daemon=True)
    t.start()
    t.join(timeout=timeout_s)
    if t.is_alive():
        done["error"] = f"recover-training did not end within {timeout_s:g}s"
    slot["recovery"] = done
    if "error" in done:
        raise RewindError(done["error"])
    if done["result"].get("status") != "recovered":
        raise RewindError(f"recover-training ended {done['result'].get('status')}: {done['result']}")
    return dict(done["result"])


def flow_runs_completed_on_own_server(configuration: dict[str, Any]) -> bool:
    """Every flow run on the drill's own Prefect server reached Completed (its states got through the restart)."""
    from prefect.client.orchestration import get_client

    if chaos.own_prefect_api(configuration) is None:
        return False
    with _prefect_of(configuration), get_client(sync_client=True) as client:
        runs = client.read_flow_runs()
    return bool(runs) and all(r.state_type is not None and r.state_type.value == "COMPLETED" for r in runs)


def replicate_to_shared(configuration: dict[str, Any]) -> list[int]:
    """Copy every restorable checkpoint of the run to the drill's shared tier (a directory), through the
    replicate phase (its checks, log lines and events), as `rewind replicate` and `replicate-offsite` do."""
    from rewind.infra.phases import replicate as phase
    from rewind.infra.phases.notify import LogNotifier

    cat, run = Catalog(), configuration["run"]
    shared = Path(configuration["state_dir"]) / "shared"  # stands in for an NFS/Lustre mount
    shared.mkdir(parents=True, exist_ok=True)
    tier, notify = phase.open_target(str(shared)), LogNotifier()  # checked reachable and writable
    made = [
        phase.replicate_checkpoint(cat, checkpoint_id=ck_id, tier=tier, notify=notify)
        for ck_id in phase.pending(cat, tier=tier, run=run)
    ]
    return [m.step for m in made]


# -- one drill ------------------------------------------------------------------------------------


def chaos_runner() -> Any:
    """chaostoolkit-lib's ``run_experiment`` (an optional extra: a clear error without it)."""
    try:
        from chaoslib.experiment import run_experiment
    except ImportError as exc:
        raise ConfigError(f"{exc}: install the drills extra (pip install 'rewind[drills]')") from exc
    return run_experiment


def run_one(
    scenario: str,
    *,
    slo_file: str | None = None,
    job: dict[str, Any] | None = None,
    job_spec: JobSpec | None = None,
) -> dict[str, Any]:
    """Run one scenario through chaostoolkit-lib, measure it, judge it against the SLO, record it.

    ``job`` changes the example job's settings; ``job_spec`` runs the user's job instead (its command and
    env take the drill's run name as ``{run}``; see ``check_job_spec``)."""
    run_experiment = chaos_runner()
    experiment = experiments.load(scenario)
    ext = experiments.rewind_ext(experiment)
    kind = str(ext.get("failure_kind", "crash"))
    slos = slo.load(slo_file)
    budget = slos.for_kind(kind)
    spec = drill_job.check_job_spec(job_spec) if job_spec is not None else None
    cat = Catalog()
    started = datetime.now(UTC)
    skip = experiments.skip_reason(ext, spec)
    if skip:
        return _skipped(cat, scenario, kind, started, skip, budget.as_dict(), spec)
    if kind == "serving":  # the drill's own serving stack, not a training job
        from rewind.flows.drills_serving import run_serving

        return run_serving(scenario, experiment, budget, slos.source)
    job_cfg = {**drill_job.JOB_DEFAULTS, **(ext.get("job") or {}), **(job or {})}
    run = f"drill-{scenario}-{uuid.uuid4().hex[:6]}"
    state = drill_job.home() / "drills" / run
    state.mkdir(parents=True, exist_ok=True)
    pool, pending = _reference(job_cfg, spec)
    configuration = {
        "run": run, "state_dir": str(state), "job": job_cfg, "slo_file": slo_file, "job_spec": spec,
        "servers_stopped_by": "rewind",  # after measuring: the job's incident may be in the drill's own catalog
    }  # fmt: skip
    experiment = {**experiment, "configuration": configuration}
    t0 = time.monotonic()
    found: list[Any] = []
    own = None
    try:
        journal = run_experiment(experiment)
        own = chaos.own_catalog(configuration)
        with contextlib.suppress(NotFoundError):
            found = incidents.incidents_of(Catalog(own) if own else cat, run)
    finally:
        os.environ.pop("REWIND_FAULT", None)
        os.environ.pop("REWIND_FAULT_ONCE", None)
        chaos.stop_servers(now=True, configuration=configuration)  # a drill never leaves a server behind
    try:
        reference = pending.result(timeout=600)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return _record(cat, scenario, kind, run, started, t0, journal, found, own, reference, state, budget,
                   slos.source, job_cfg, spec, ext)  # fmt: skip


def _skipped(
    cat: Catalog,
    scenario: str,
    kind: str,
    started: datetime,
    reason: str,
    budget: dict[str, Any],
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
    """A scenario this machine cannot run, recorded as skipped with the reason."""
    drill_id = drill_rows.record(
        cat, scenario=scenario, failure_kind=kind, started_at=started, outcome="skipped",
        reason=reason, slo=budget, details={"job_spec": spec} if spec else {},
    )  # fmt: skip
    return {"id": drill_id, "scenario": scenario, "outcome": "skipped", "reason": reason, "as_expected": True}


def _reference(
    job_cfg: dict[str, Any], spec: dict[str, Any] | None
) -> tuple[ThreadPoolExecutor, Future[Any]]:
    """The uninterrupted reference run, started in its own process beside the drill (the environment
    copied now, before a fault is armed)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="drill-reference")
    keys = ("steps", "every", "seed", "module", "nnodes", "nproc_per_node")
    ref_job = {k: v for k, v in job_cfg.items() if k in keys}
    return pool, pool.submit(drill_job.reference_curve, ref_job, dict(os.environ), spec)


def _record(
    cat: Catalog,
    scenario: str,
    kind: str,
    run: str,
    started: datetime,
    t0: float,
    journal: dict[str, Any],
    found: list[Any],
    own: str | None,
    reference: dict[int, float],
    state: Path,
    budget: slo.Budget,
    source: str,
    job_cfg: dict[str, Any],
    spec: dict[str, Any] | None,
    ext: dict[str, Any],
) -> dict[str, Any]:
    """The drill's measurements and verdict, recorded; what `rewind drill run` prints of it."""
    expected = ext.get("expect_failure_at")  # a scenario that breaks a phase on purpose
    error = _journal_error(journal)
    inc = found[0] if found else None
    m = measure.measure(inc, measure.read_log(state / "loss.jsonl"), reference, error)
    verdict = _judge(m, budget, incident=inc, error=error, optional=ext.get("incident") == "optional")
    drill_id = drill_rows.record(
        cat, scenario=scenario, failure_kind=kind, run_name=run, incident_id=inc.id if inc and not own else None,
        started_at=started, outcome="passed" if verdict.passed else "failed", phases=m["phases"],
        rto_s=m["rto_s"], rpo_steps=m["rpo_steps"], rpo_s=m["rpo_s"], loss_max_deviation=m["loss_max_deviation"],
        loss_curve=m["loss_curve"], failed_phase=verdict.failed_phase, reason=verdict.reason,
        seed=int(job_cfg["seed"]), slo={**budget.as_dict(), "source": source},
        details={"journal_status": journal.get("status"), "deviated": journal.get("deviated"),
                 "wall_s": round(time.monotonic() - t0, 2), "job": None if spec else job_cfg,
                 "job_spec": spec, "error": error, "expected_failure_at": expected,
                 "topology_rebuild_s": m["topology_rebuild_s"], "detection": m["detection"],
                 "restore_read_from": m["restore_read_from"], "comeback": m["comeback"],
                 "activities": _outputs(journal),
                 "own_catalog_incident": {"id": inc.id, "kind": inc.kind, "reason": inc.reason}
                 if inc is not None and own else None},
    )  # fmt: skip
    return {"id": drill_id, "scenario": scenario, "outcome": "passed" if verdict.passed else "failed",
            "failed_phase": verdict.failed_phase, "reason": verdict.reason, "rto_s": m["rto_s"],
            "rpo_steps": m["rpo_steps"], "run": run, "phases": m["phases"],
            "topology_rebuild_s": m["topology_rebuild_s"],
            "as_expected": verdict.failed_phase == expected if expected else verdict.passed}  # fmt: skip


def _judge(
    m: dict[str, Any], budget: slo.Budget, *, incident: Any, error: str | None, optional: bool
) -> slo.Verdict:
    """The drill's verdict from its measurements (``m``'s phases are completed here where none ran)."""
    if incident is None and error is None and optional:
        # The job rode the fault out: nothing to recover, so no phase ran and there is no RTO.
        m["phases"] = {n: {"s": None, "status": "not_needed"} for n in slo.PHASES}
        return slo.Verdict(True, None, "the job rode the fault out: no incident, nothing to recover")
    if incident is None:
        m["phases"]["detect"] = {"s": None, "status": "failed", "why": error or "no incident was recorded"}
    verdict = slo.judge(budget, m["phases"], m["rto_s"], m["rpo_steps"])
    return slo.Verdict(False, None, error) if error and verdict.passed else verdict


def _outputs(journal: dict[str, Any]) -> dict[str, Any]:
    """What each activity of the method returned, where it is plain data (what was hurt, what was resent)."""
    out: dict[str, Any] = {}
    for r in journal.get("run") or []:
        try:
            json.dumps(r.get("output"))
        except (TypeError, ValueError):
            continue
        if r.get("output") is not None:
            out[r["activity"]["name"]] = r["output"]
    return out


def _journal_error(journal: dict[str, Any]) -> str | None:
    """The first activity that failed, or the hypothesis that did not hold, as one line."""
    for r in journal.get("run") or []:
        if r.get("status") == "failed":
            return f"{r['activity']['name']}: {r.get('exception', [''])[-1].strip() if r.get('exception') else 'failed'}"
    after = journal.get("steady_states", {}).get("after") or {}
    for p in after.get("probes") or []:
        if not p.get("tolerance_met", True):
            return f"steady state not met after the method: {p['activity']['name']}"
    if journal.get("status") not in ("completed", None):
        return f"experiment {journal.get('status')}"
    return None


def run_many(names: list[str], **kw: Any) -> list[dict[str, Any]]:
    """Run ``names`` in order (``run_one``'s keywords apply to each)."""
    unknown = [n for n in names if n not in experiments.load_all()]
    if unknown:
        raise ConfigError(f"no drill scenario {', '.join(unknown)}; `rewind drill list` shows them")
    return [run_one(n, **kw) for n in names]


@flow(name="run-drills")
def run_drills(
    scenarios: list[str] | None = None, slo_file: str | None = None, job_spec_file: str | None = None
) -> list[dict[str, Any]]:
    """Run recovery drills (default: every scenario) and publish the results as an artifact.

    Args:
        scenarios: Scenario names (`rewind drill list`); empty runs them all.
        slo_file: The SLO file to judge against (default: $REWIND_SLO_FILE or ./rewind-slo.yaml).
        job_spec_file: A job spec (JSON or YAML) to drill instead of the example job; its command takes
            the drill's run name as {run} (and may take {out} and {loss_log}).
    """
    from rewind.infra.launch.spec import load_file

    names = scenarios or list(experiments.load_all())
    spec = load_file(job_spec_file) if job_spec_file else None
    results = run_many(names, slo_file=slo_file, job_spec=spec)
    lines = [
        "# Recovery drills",
        "",
        "| scenario | outcome | RTO s | replayed | failed phase | why |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        rto = f"{r['rto_s']:.2f}" if r.get("rto_s") is not None else "-"
        lines.append(f"| {r['scenario']} | {r['outcome']} | {rto} | {r.get('rpo_steps', '-')} | "
                     f"{r.get('failed_phase') or '-'} | {r.get('reason') or ''} |")  # fmt: skip
    create_markdown_artifact(key="rewind-drills", markdown="\n".join(lines))
    create_table_artifact(
        key="rewind-drill-phases",
        table=[
            {"scenario": r["scenario"], "outcome": r["outcome"], "failed_phase": r.get("failed_phase") or "",
             **{n: (r.get("phases") or {}).get(n, {}).get("s") for n in slo.ALL_PHASES}}
            for r in results
        ],
        description="Seconds per recovery phase of each drill (rewind drill report has the plots).",
    )  # fmt: skip
    get_run_logger().info("%d drills: %s", len(results), {r["scenario"]: r["outcome"] for r in results})
    return results
