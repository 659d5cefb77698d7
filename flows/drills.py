"""Recovery drills: Chaos Toolkit experiments run by chaostoolkit-lib against a real job under Rewind's flows.

The experiment's actions that hurt the job live in ``infra.drills.chaos`` (no Prefect); the ones here
start the job under ``protect-training``, wait for the failure and run ``recover-training``, exactly as
the automation would. Each drill is recorded in the catalog (``drill`` table) with its phases, RTO, RPO,
post-recovery loss curve against an uninterrupted reference run, and the phase that broke its SLO.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.catalog import drills as drill_rows
from infra.catalog import incidents
from infra.catalog.db import Catalog
from infra.drills import experiments, measure, slo
from infra.errors import ConfigError, NotFoundError

REPO = Path(__file__).resolve().parents[1]
JOB_DEFAULTS: dict[str, Any] = {"steps": 40, "every": 10, "seed": 0, "step_time_s": 0.15}
_ACTIVE: dict[str, dict[str, Any]] = {}  # run -> the protect thread, its result, recovery's result


def _home() -> Path:
    return Path(os.environ.get("REWIND_HOME") or Path.home() / ".rewind").expanduser()


def _job(configuration: dict[str, Any]) -> dict[str, Any]:
    return {**JOB_DEFAULTS, **(configuration.get("job") or {})}


def _command(configuration: dict[str, Any], run: str, out: Path, log: Path) -> list[str]:
    j = _job(configuration)
    return [
        "python", "-m", "examples.tiny_lm", "--run", run, "--steps", str(j["steps"]),
        "--checkpoint-every", str(j["every"]), "--seed", str(j["seed"]), "--out", str(out),
        "--step-time-s", str(j["step_time_s"]), "--loss-log", str(log), *j.get("extra", []),
    ]  # fmt: skip


# -- actions named by the experiments --------------------------------------------------------------


def start_protected(configuration: dict[str, Any]) -> str:
    """Start the drill's job under protect-training (in a thread: the next actions hurt it meanwhile)."""
    from flows.training import protect_training

    run, state = configuration["run"], Path(configuration["state_dir"])
    j = _job(configuration)
    cmd = _command(configuration, run, state / "out", state / "loss.jsonl")
    slot: dict[str, Any] = {"result": None, "error": None}
    hang_s = float(j["heartbeat_timeout_s"]) if j.get("heartbeat_timeout_s") else None

    def go() -> None:
        try:
            slot["result"] = protect_training(
                run, cmd, str(REPO), env={"OMP_NUM_THREADS": "1"}, heartbeat_timeout_s=hang_s
            )
        except BaseException as exc:
            slot["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=go, name=f"drill-protect-{run}", daemon=True)
    slot["thread"] = t
    _ACTIVE[run] = slot
    t.start()
    return run


def await_failure(configuration: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """Wait (bounded) for protect-training to end; the job must have failed (an incident)."""
    slot = _ACTIVE[configuration["run"]]
    slot["thread"].join(timeout=timeout_s)
    if slot["thread"].is_alive():
        raise TimeoutError(f"protect-training of {configuration['run']} did not end within {timeout_s:g}s")
    if slot["error"]:
        raise RuntimeError(f"protect-training failed: {slot['error']}")
    result = slot["result"]
    if not result.get("incident_id"):
        raise RuntimeError(f"the fault did not stop the job: {result}")
    return dict(result)


def recover(configuration: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """Run recover-training on the drill's incident, as the failure event's automation would."""
    from flows.training import recover_training

    slot = _ACTIVE.get(configuration["run"]) or {}
    incident_id = (slot.get("result") or {}).get("incident_id")
    if incident_id is None:
        raise RuntimeError("no incident to recover: the job did not fail as the experiment meant it to")
    done: dict[str, Any] = {}

    def go() -> None:
        try:
            done["result"] = recover_training(incident_id)
        except BaseException as exc:
            done["error"] = f"{type(exc).__name__}: {exc}"

    t = threading.Thread(target=go, name=f"drill-recover-{incident_id}", daemon=True)
    t.start()
    t.join(timeout=timeout_s)
    if t.is_alive():
        done["error"] = f"recover-training did not end within {timeout_s:g}s"
    slot["recovery"] = done
    if "error" in done:
        raise RuntimeError(done["error"])
    if done["result"].get("status") != "recovered":
        raise RuntimeError(f"recover-training ended {done['result'].get('status')}: {done['result']}")
    return dict(done["result"])


def replicate_to_shared(configuration: dict[str, Any]) -> list[int]:
    """Copy every restorable checkpoint of the run to the drill's shared tier (a directory)."""
    from infra.catalog import lineage
    from infra.replication import replicate
    from infra.tiers import open_tier

    cat, run = Catalog(), configuration["run"]
    shared = Path(configuration["state_dir"]) / "shared"  # stands in for an NFS/Lustre mount
    shared.mkdir(parents=True, exist_ok=True)
    tier = open_tier(str(shared))
    done = []
    for ck in lineage.restorable(cat, lineage.get_run(cat, run).id):
        replicate(cat, ck, tier)
        done.append(ck.step)
    return done


# -- one drill ------------------------------------------------------------------------------------


def reference_curve(job: dict[str, Any], environ: dict[str, str] | None = None) -> dict[int, float]:
    """The loss per step of the same job uninterrupted and unsupervised (own SQLite catalog), cached."""
    h = hashlib.sha256(json.dumps(job, sort_keys=True).encode())
    for src in ("examples/tiny_lm.py", "examples/tiny_lm_model.py"):  # a changed example: a new reference
        h.update((REPO / src).read_bytes())
    key = h.hexdigest()[:12]
    cached = _home() / "drills" / f"reference-{key}.jsonl"
    if not cached.exists():
        cached.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="rewind-ref-") as tmp:
            log = Path(tmp) / "loss.jsonl"
            cmd = _command({"job": {**job, "step_time_s": 0.0}}, "reference", Path(tmp) / "out", log)
            cmd[0] = sys.executable
            own = {
                "REWIND_HOME": tmp,
                "REWIND_CATALOG_URL": "",
                "REWIND_CHECKPOINT_ROOT": "",
                "OMP_NUM_THREADS": "1",
            }
            env = {**(environ if environ is not None else os.environ), **own}
            for k in ("REWIND_FAULT", "REWIND_FAULT_ONCE"):
                env.pop(k, None)
            cmd = _without_poison(cmd)
            done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"the reference run failed: {done.stdout[-500:]}{done.stderr[-500:]}")
            os.replace(log, cached)
    return measure.reference_losses(measure.read_log(cached))


def _without_poison(cmd: list[str]) -> list[str]:
    out, skip = [], False
    for c in cmd:
        if skip:
            skip = False
            continue
        if c == "--poison-position":
            skip = True
            continue
        out.append(c)
    return out


def run_one(
    scenario: str, *, slo_file: str | None = None, job: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run one scenario through chaostoolkit-lib, measure it, judge it against the SLO, record it."""
    from chaoslib.experiment import run_experiment

    experiment = experiments.load(scenario)
    ext = experiments.rewind_ext(experiment)
    kind = str(ext.get("failure_kind", "crash"))
    slos = slo.load(slo_file)
    budget = slos.for_kind(kind)
    cat = Catalog()
    started = datetime.now(UTC)
    if ext.get("skip"):
        drill_id = drill_rows.record(
            cat, scenario=scenario, failure_kind=kind, started_at=started, outcome="skipped",
            reason=str(ext["skip"]), slo=budget.as_dict(),
        )  # fmt: skip
        return {
            "id": drill_id,
            "scenario": scenario,
            "outcome": "skipped",
            "reason": ext["skip"],
            "as_expected": True,
        }
    expected = ext.get("expect_failure_at")  # a scenario that breaks a phase on purpose
    job_cfg = {**JOB_DEFAULTS, **(ext.get("job") or {}), **(job or {})}
    run = f"drill-{scenario}-{uuid.uuid4().hex[:6]}"
    state = _home() / "drills" / run
    state.mkdir(parents=True, exist_ok=True)
    pool = ThreadPoolExecutor(1, thread_name_prefix="drill-reference")  # its own process, beside the drill
    ref_job = {k: v for k, v in job_cfg.items() if k in ("steps", "every", "seed")}
    pending = pool.submit(reference_curve, ref_job, dict(os.environ))  # copied before a fault is armed
    configuration = {"run": run, "state_dir": str(state), "job": job_cfg, "slo_file": slo_file}
    experiment = {**experiment, "configuration": configuration}
    t0 = time.monotonic()
    try:
        journal = run_experiment(experiment)
    finally:
        os.environ.pop("REWIND_FAULT", None)
        os.environ.pop("REWIND_FAULT_ONCE", None)
    try:
        reference = pending.result(timeout=300)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    error = _journal_error(journal)
    try:
        found = incidents.incidents_of(cat, run)
    except NotFoundError:
        found = []
    inc = found[0] if found else None
    m = measure.measure(inc, measure.read_log(state / "loss.jsonl"), reference, error)
    if inc is None:
        m["phases"]["detect"] = {"s": None, "status": "failed", "why": error or "no incident was recorded"}
    verdict = slo.judge(budget, m["phases"], m["rto_s"], m["rpo_steps"])
    if error and verdict.passed:
        verdict = slo.Verdict(False, None, error)
    drill_id = drill_rows.record(
        cat, scenario=scenario, failure_kind=kind, run_name=run, incident_id=inc.id if inc else None,
        started_at=started, outcome="passed" if verdict.passed else "failed", phases=m["phases"],
        rto_s=m["rto_s"], rpo_steps=m["rpo_steps"], rpo_s=m["rpo_s"], loss_max_deviation=m["loss_max_deviation"],
        loss_curve=m["loss_curve"], failed_phase=verdict.failed_phase, reason=verdict.reason,
        seed=int(job_cfg["seed"]), slo={**budget.as_dict(), "source": slos.source},
        details={"journal_status": journal.get("status"), "deviated": journal.get("deviated"),
                 "wall_s": round(time.monotonic() - t0, 2), "job": job_cfg, "error": error,
                 "expected_failure_at": expected},
    )  # fmt: skip
    return {"id": drill_id, "scenario": scenario, "outcome": "passed" if verdict.passed else "failed",
            "failed_phase": verdict.failed_phase, "reason": verdict.reason, "rto_s": m["rto_s"],
            "rpo_steps": m["rpo_steps"], "run": run, "phases": m["phases"],
            "as_expected": verdict.failed_phase == expected if expected else verdict.passed}  # fmt: skip


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
    unknown = [n for n in names if n not in experiments.load_all()]
    if unknown:
        raise ConfigError(f"no drill scenario {', '.join(unknown)}; `rewind drill list` shows them")
    return [run_one(n, **kw) for n in names]


@flow(name="run-drills")
def run_drills(scenarios: list[str] | None = None, slo_file: str | None = None) -> list[dict[str, Any]]:
    """Run recovery drills (default: every scenario) and publish the results as an artifact.

    Args:
        scenarios: Scenario names (`rewind drill list`); empty runs them all.
        slo_file: The SLO file to judge against (default: $REWIND_SLO_FILE or ./rewind-slo.yaml).
    """
    names = scenarios or list(experiments.load_all())
    results = run_many(names, slo_file=slo_file)
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
             **{n: (r.get("phases") or {}).get(n, {}).get("s") for n in slo.PHASES}}
            for r in results
        ],
        description="Seconds per recovery phase of each drill (rewind drill report has the plots).",
    )  # fmt: skip
    get_run_logger().info("%d drills: %s", len(results), {r["scenario"]: r["outcome"] for r in results})
    return results
