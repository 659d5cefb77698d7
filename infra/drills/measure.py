"""From what recovery recorded on the incident and the job's loss log to a drill's phases, RTO, RPO and curve.

Phases, in the order recovery runs them (seconds; ``None`` where it did not happen):
detect (failure to incident: ``detection_s``), decide (incident to the recovery flow: ``flow_start_s``
less detection), restore (restore point found and its manifest proven: ``load_s``; failed when the
job's own hashing read of it failed), rebuild (the relaunch
decided and started), relaunch (process start to the job resumed, restore inside the job included:
the job's ``resumed`` log line), first_step (resumed to the first step done), replay (the first step to
the step the failed launch had reached: the work done twice).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rewind.infra.drills.slo import PHASES

CURVE_STEPS = 100  # the post-recovery loss curve compared with the reference: its first 100 steps


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a SIGKILL
    return out


def reference_losses(records: list[dict[str, Any]]) -> dict[int, float]:
    return {int(r["step"]): float(r["loss"]) for r in records if "step" in r}


def _phases(
    seconds: dict[str, float | None], *, nothing_to_replay: bool, error: str | None
) -> dict[str, dict[str, Any]]:
    """Each phase measured (ok), or the first one unmeasured failed with ``error`` and the rest skipped."""
    phases: dict[str, dict[str, Any]] = {}
    broken = False
    for name in PHASES:
        s = seconds[name]
        if s is not None:
            phases[name] = {"s": round(max(0.0, s), 4), "status": "ok"}
        elif name == "replay" and seconds["first_step"] is not None and nothing_to_replay:
            phases[name] = {"s": 0.0, "status": "ok"}
        elif not broken and error is not None:
            broken = True
            phases[name] = {"s": None, "status": "failed", "why": error}
        else:
            phases[name] = {"s": None, "status": "skipped" if broken else "not_measured"}
    return phases


def _curve(
    steps_after: list[dict[str, Any]], reference: dict[int, float]
) -> tuple[dict[str, list[Any]] | None, float | None]:
    """The first ``CURVE_STEPS`` losses after the recovery beside the reference's, and the largest gap."""
    steps = [r["step"] for r in steps_after][:CURVE_STEPS]
    loss = [float(r["loss"]) for r in steps_after][:CURVE_STEPS]
    ref = [reference.get(s) for s in steps]
    devs = [abs(a - b) for a, b in zip(loss, ref, strict=True) if b is not None and a == a]
    curve = {"steps": steps, "loss": loss, "reference": ref} if steps else None
    return curve, max(devs) if devs else None


def measure(
    incident: Any, log: list[dict[str, Any]], reference: dict[int, float], error: str | None = None
) -> dict[str, Any]:
    """Phases (``{name: {"s", "status"[, "why"]}}``), RTO, RPO and the post-recovery curve of one drill."""
    d = dict(incident.details or {}) if incident is not None else {}
    died = d.get("died_at")
    failed_launch = str(d.get("launch_id")) if d.get("launch_id") is not None else None
    flow_s, load_s = d.get("flow_start_s"), getattr(incident, "load_s", None)
    first_seen, rebuild_s = d.get("first_step_after_restore_at"), getattr(incident, "rebuild_s", None)
    launched = first_seen - rebuild_s if first_seen is not None and rebuild_s is not None else None
    after = [r for r in log if died is not None and r.get("t", 0) > died and r.get("launch") != failed_launch]
    resumed = next((r for r in after if r.get("event") == "resumed"), None)
    steps_after = [r for r in after if "step" in r]
    # The failed launch's own last step: the incident's is the last one reported (up to a second stale).
    logged = [int(r["step"]) for r in log if "step" in r and r.get("launch") == failed_launch]
    last = max(logged) if logged else d.get("last_step")
    restored = d.get("resumed_at_step")
    replay_end = next((r for r in steps_after if last is not None and r["step"] >= last), None)
    detect = getattr(incident, "detection_s", None)
    seconds: dict[str, float | None] = {
        "detect": detect,
        "decide": max(0.0, flow_s - (detect or 0.0)) if flow_s is not None else None,
        "restore": None if d.get("restore_failed_in_job") else load_s,  # the job's own read failed it
        "rebuild": launched - (died + flow_s + load_s)
        if launched is not None and died is not None and flow_s is not None and load_s is not None
        else None,
        "relaunch": resumed["t"] - launched if resumed and launched is not None else None,
        "first_step": steps_after[0]["t"] - resumed["t"] if resumed and steps_after else None,
        "replay": replay_end["t"] - steps_after[0]["t"] if replay_end and steps_after else None,
    }
    phases = _phases(seconds, nothing_to_replay=(last or 0) <= (restored or 0), error=error)
    before = {r["step"]: r["t"] for r in log if "step" in r and r.get("t", 0) <= (died or 0)}
    rpo_s = died - before[restored] if died is not None and restored in before else None
    curve, deviation = _curve(steps_after, reference)
    return {
        "phases": phases,
        "rto_s": getattr(incident, "rto_s", None),
        "rpo_steps": last - restored
        if last is not None and restored is not None
        else getattr(incident, "replayed_steps", None),
        "rpo_s": round(rpo_s, 4) if rpo_s is not None else None,
        "loss_max_deviation": deviation,
        "loss_curve": curve,
        # inside relaunch: from the launch to every rank's process group passing its smoke test
        "topology_rebuild_s": d.get("group_ready_s"),
        "detection": d.get("detection"),  # when each signal told of the failure
        "restore_read_from": d.get("restore_read_from"),  # where the restore point's bytes came from
        "comeback": d.get("comeback"),  # the replayed steps' losses against the same steps before the failure
    }
