"""The catalog's overview (``overview.status``) as text for people: `rewind status` and the status artifact."""

from __future__ import annotations

from typing import Any

from rewind.infra import sizes


def ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.1f}{unit}"
    return f"{s:.1f}s"


SHOWN_PROCESSES = 8  # more ranks than this: the first ones, and how many more (--json lists all)


def _processes(procs: list[dict[str, Any]]) -> str:
    """``rank 0 pid 4242 on host-a, ...``: the ranks' own processes, as they reported themselves."""
    shown = ", ".join(f"rank {p['rank']} pid {p['pid']} on {p['node']}" for p in procs[:SHOWN_PROCESSES])
    more = len(procs) - SHOWN_PROCESSES
    return shown + (f", and {more} more (--json lists them)" if more > 0 else "")


def _run_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"run {r['run']}"]

    def row(label: str, value: str) -> None:
        lines.append(f"  {label:18}{value}")

    nv = r["newest_verified"]
    row(
        "newest verified",
        "none"
        if nv is None
        else f"step {nv['step']}, {ago(nv['age_s'])} ago (checkpoint {nv['checkpoint_id']})",
    )
    if r["newest_unverified"] is not None:
        u = r["newest_unverified"]
        row("not yet verified", f"step {u['step']}, {ago(u['age_s'])} ago")
    rpo, job = r["rpo"], r["job"]
    if job is not None and not job["running"]:
        shown = "" if rpo["to_step"] is None else f"; its newest reported step was {rpo['to_step']}"
        row("if it died now", f"nothing is at risk: the job is not running{shown}")
    elif rpo["steps"] is None:
        row("if it died now", "unknown: no rank reported progress to the catalog")
    else:
        secs = "" if rpo["seconds"] is None else f", {ago(rpo['seconds'])} of training"
        row("if it died now", f"{rpo['steps']} steps lost{secs} (newest reported step {rpo['to_step']})")
    if job is not None:
        state = "running" if job["running"] else f"ended, exit {job['exit_code']}"
        beat = (
            "" if job["last_report_age_s"] is None else f", last report {ago(job['last_report_age_s'])} ago"
        )
        row("job", f"launch {job['launch_id']} {state}, {job['ranks']} rank(s){beat}")
        if job["running"] and job.get("processes"):
            row("processes", _processes(job["processes"]))
        row("job output", f"{job['log_dir']} (rewind logs {r['run']})")
    if not r["tiers"]:
        row("copies", "none of a verified checkpoint")
    for i, (tier, t) in enumerate(r["tiers"].items()):
        lag = (
            "no verified copy"
            if t["newest_verified_step"] is None
            else f"newest step {t['newest_verified_step']}, lag {t['lag_steps']} steps"
            + ("" if not t["lag_steps"] or t["lag_s"] is None else f" / {ago(t['lag_s'])}")
        )
        row(
            "copies" if i == 0 else "",
            f"{tier:8}{t['copies']} ({t['verified_copies']} verified, {sizes.human(t['bytes'])}), {lag}",
        )
    if not r["open_incidents"]:
        row("open incidents", "none")
    for i, inc in enumerate(r["open_incidents"]):
        reason = " ".join(str(inc["reason"] or "").split())
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        row(
            "open incidents" if i == 0 else "",
            f"#{inc['id']} {inc['kind']} {ago(inc['age_s'])} ago: {reason}",
        )
    return lines


def _model_lines(m: dict[str, Any]) -> list[str]:
    lines = [f"model {m['model']}"]
    for v in m["versions"]:
        source = f"{v['run']}@{v['step']}"
        if v["checkpoint_id"] is not None:
            source += f" (checkpoint {v['checkpoint_id']}, {v['checkpoint_status'] or 'gone'})"
        lines.append(f"  {v['version']:10}{v['state']:12}weight {v['weight']:<5}{source}")
    return lines


def text(got: dict[str, Any], *, catalog: str | None = None) -> str:
    """For people; ``catalog`` (the URL, password masked) is named when it holds no run, so that an
    unset or mistyped REWIND_CATALOG_URL reads as what it is."""
    empty = f"no runs in catalog {catalog}" if catalog else "no runs"
    blocks = ["\n".join(_run_lines(r)) for r in got["runs"]] or [empty]
    blocks += ["\n".join(_model_lines(m)) for m in got["models"]]
    return "\n\n".join(blocks)
