"""Serving drills: a TorchServe instance killed under load, a bad model version rolled out under load.

Each starts a serving stack of its own (``rewind.infra.drills.serving``: the example model trained into a
catalog in the drill's directory, TorchServe behind HAProxy, clients through the proxy), deploys and rolls
out through the same flows as a user's deploy (``deploy-model``, ``rollout-model``), and is recorded in
the catalog the drill was started with: the failed client requests, the restart or rollback time, the
phases, judged against the ``serving`` SLO.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rewind.infra.catalog import drills as drill_rows
from rewind.infra.catalog import serving as sv
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import chaos, slo
from rewind.infra.drills import job as drill_job
from rewind.infra.drills.context import run_of
from rewind.infra.drills.serving import MODEL
from rewind.infra.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HANDLER = EXAMPLES / "tiny_lm_handler.py"
PROBES = EXAMPLES / "tiny_lm_probes.jsonl"
# the activity whose failure is the phase's (anything else failing is the drill's own setup)
PHASE_OF = {"kill-instance": "restart", "roll-out-bad-version": "detect"}


# -- actions named by the experiments --------------------------------------------------------------


def deploy_first(step: int = 60, configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Deploy the drill's checkpoint at ``step`` as the model's first version (it takes all traffic)."""
    from rewind.flows.drills import _prefect_of
    from rewind.flows.serving import deploy_model

    with _prefect_of(configuration or {}):
        out = deploy_model(MODEL, run_of(configuration), step, handler=str(HANDLER),
                           extra_files=[str(EXAMPLES / "tiny_lm_model.py")], triggered_by="drill")  # fmt: skip
    return {"version": out["version"], "stable": out["stable"], "load_s": out.get("load_s")}


def roll_out_bad_version(bake_s: float = 2.0, configuration: dict[str, Any] | None = None) -> dict[str, Any]:
    """Roll out the bad version (``make_bad_version``'s) behind the quality gate, 50% then 100%: the gates
    must roll it back. Returns the rollout's end, when the canary first took traffic and when the gates
    decided."""
    from rewind.flows.drills import _prefect_of
    from rewind.flows.serving import rollout_model

    bad = chaos.held_servers(configuration).get("bad_version")
    if bad is None:
        raise ConfigError("the drill made no bad version (make_bad_version comes first)")
    with _prefect_of(configuration or {}):
        out = rollout_model(
            MODEL, bad["run"], bad["step"], traffic_steps=[50, 100], bake_s=bake_s, max_error_rate=0.05,
            max_p95_latency_ms=5000.0, min_quality=round(bad["good_quality"] / 2, 3), probe_set=str(PROBES),
            warm_s=0.0, triggered_by="drill",
        )  # fmt: skip
    cat = Catalog()
    row = sv.get_rollout(cat, out["rollout_id"])
    canary = next((st.at for st in sv.steps_of(cat, row.id)
                   if st.action == "set_traffic" and (st.weights or {}).get(out["version"], 0) > 0), None)  # fmt: skip
    return {**out, "canary_at": _epoch(canary), "decided_at": _epoch(row.decided_at)}


def _epoch(at: datetime | None) -> float | None:
    return None if at is None else (at if at.tzinfo else at.replace(tzinfo=UTC)).timestamp()


# -- one drill ------------------------------------------------------------------------------------


def run_serving(scenario: str, experiment: dict[str, Any], budget: slo.Budget, source: str) -> dict[str, Any]:
    """Run a serving scenario through chaostoolkit-lib, measure it from its clients, judge and record it."""
    from rewind.flows.drills import _journal_error, _outputs, chaos_runner

    run_experiment = chaos_runner()

    cat = Catalog()  # the drill's record goes here; the stack's catalog is the drill's own
    seed = random.SystemRandom().randrange(2**31)  # which instance is killed: recorded with the drill
    run = f"drill-{scenario}-{uuid.uuid4().hex[:6]}"
    state = drill_job.home() / "drills" / run
    state.mkdir(parents=True, exist_ok=True)
    configuration = {"run": run, "state_dir": str(state), "seed": seed}
    started, t0 = datetime.now(UTC), time.monotonic()
    try:
        journal = run_experiment({**experiment, "configuration": configuration})
    finally:
        with contextlib.suppress(Exception):
            chaos.stop_servers(now=True, configuration=configuration)  # never a server left behind
    outputs, error = _outputs(journal), _journal_error(journal)
    phases, rto_s = _measure(outputs)
    traffic = outputs.get("stop-traffic")
    served_bad = _answers_of_bad_version(outputs, traffic)
    if error is not None:
        failing = next((PHASE_OF[n] for n in PHASE_OF if error.startswith(n)), None)
        if failing:
            phases[failing] = {"s": None, "status": "failed", "why": error}
    verdict = slo.judge_serving(budget, phases, rto_s, traffic["failed"] if traffic else None)
    if error is not None and (verdict.passed or verdict.failed_phase is None):
        verdict = slo.Verdict(False, verdict.failed_phase, error)
    outcome = "passed" if verdict.passed else "failed"
    drill_id = drill_rows.record(
        cat, scenario=scenario, failure_kind="serving", run_name=run, started_at=started, outcome=outcome,
        phases=phases, rto_s=rto_s, failed_phase=verdict.failed_phase, reason=verdict.reason, seed=seed,
        slo={**budget.as_dict(), "source": source},
        details={"journal_status": journal.get("status"), "error": error, "traffic": traffic,
                 "bad_version_answers": served_bad, "wall_s": round(time.monotonic() - t0, 2),
                 "activities": outputs},
    )  # fmt: skip
    return {"id": drill_id, "scenario": scenario, "outcome": outcome, "failed_phase": verdict.failed_phase,
            "reason": verdict.reason, "rto_s": rto_s, "rpo_steps": None, "run": run, "phases": phases,
            "failed_requests": traffic["failed"] if traffic else None,
            "requests": traffic["requests"] if traffic else None, "bad_version_answers": served_bad,
            "as_expected": verdict.passed}  # fmt: skip


def _answers_of_bad_version(outputs: dict[str, Any], traffic: dict[str, Any] | None) -> int | None:
    """How many client requests the bad version answered before the rollback (None: no bad rollout)."""
    rolled = outputs.get("roll-out-bad-version")
    if rolled is None or traffic is None:
        return None
    return int(traffic["versions"].get(rolled.get("version"), {}).get("answers", 0))


def _measure(outputs: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], float | None]:
    """The phases and the time back to full service, from what the actions returned."""
    killed = outputs.get("kill-instance")
    if killed is not None:
        return {"restart": {"s": killed["back_s"], "status": "ok"}}, killed["back_s"]
    rolled = outputs.get("roll-out-bad-version")
    if rolled is None:
        return {}, None
    if rolled.get("state") != "rolled_back":
        why = f"the bad version was not rolled back: the rollout ended {rolled.get('state')}"
        return {"detect": {"s": None, "status": "failed", "why": why}}, None
    canary, decided, switch = rolled.get("canary_at"), rolled.get("decided_at"), rolled.get("switch_s")
    if canary is None or decided is None or switch is None:
        return {"detect": {"s": None, "status": "not_measured"}}, None
    detect = round(decided - canary, 3)
    return {"detect": {"s": detect, "status": "ok"}, "rollback": {"s": switch, "status": "ok"}}, round(
        detect + switch, 3
    )
