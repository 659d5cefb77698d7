"""`rewind drill report`: one self-contained HTML page (tables, and matplotlib plots as embedded PNG)."""

from __future__ import annotations

import base64
import html
import io
import statistics
from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

from rewind.infra.drills.slo import ALL_PHASES


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return html.escape(str(v))


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return '<img alt="plot" src="data:image/png;base64,' + base64.b64encode(buf.getvalue()).decode() + '">'


def _plots(drills: list[Any]) -> list[tuple[str, str]]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [("plots", "<p>matplotlib is not installed (the <code>drills</code> extra): no plots.</p>")]
    out = []
    ran = [d for d in drills if d.outcome != "skipped"]
    if ran:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(ran) + 1.5))
        labels = [f"{d.scenario} #{d.id}" for d in ran]
        left = [0.0] * len(ran)
        for name in ALL_PHASES:
            vals = [float((d.phases.get(name) or {}).get("s") or 0.0) for d in ran]
            ax.barh(labels, vals, left=left, label=name)
            left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.set_xlabel("seconds")
        ax.set_title("Recovery time per phase (RTO ends at first_step; replay comes after it)")
        ax.legend(loc="lower right", fontsize=8)
        ax.invert_yaxis()
        out.append(("RTO per phase", _png(fig)))
        fig, ax = plt.subplots(figsize=(9, 3.5))
        by_kind: dict[str, list[tuple[datetime, float]]] = defaultdict(list)
        for d in ran:
            if d.rto_s is not None:
                by_kind[d.failure_kind].append((d.started_at, d.rto_s))
        for kind, pts in sorted(by_kind.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)  # type: ignore[arg-type]
        ax.set_ylabel("RTO (s)")
        ax.set_title("RTO by failure kind over time")
        if by_kind:
            ax.legend(fontsize=8)
        fig.autofmt_xdate()
        out.append(("RTO by failure kind over time", _png(fig)))
    curved = [d for d in ran if d.loss_curve]
    if curved:
        fig, ax = plt.subplots(figsize=(9, 3.5))
        for d in curved[-6:]:
            c = d.loss_curve
            ax.plot(c["steps"], c["loss"], label=f"{d.scenario} #{d.id}")
        ref = max(curved, key=lambda d: len(d.loss_curve["steps"])).loss_curve
        ax.plot(ref["steps"], ref["reference"], "k--", label="reference (uninterrupted)")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("Loss after recovery against the reference run")
        ax.legend(fontsize=8)
        out.append(("Loss curve after recovery", _png(fig)))
    return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _drill_row(d: Any) -> str:
    """One drill: its measures, each phase's seconds (and status when not ok), what its clients saw."""
    phases = " ".join(
        f"{n}={_fmt((d.phases.get(n) or {}).get('s'))}"
        + ("" if (d.phases.get(n) or {}).get("status") in ("ok", None) else f"[{d.phases[n]['status']}]")
        for n in ALL_PHASES
        if d.phases.get(n)
    )
    traffic = (d.details or {}).get("traffic")
    if traffic:  # a serving drill: what its clients saw through the fault
        phases += f" requests={traffic['requests']} failed={traffic['failed']}"
        if (d.details or {}).get("bad_version_answers") is not None:
            phases += f" answered_by_bad_version={d.details['bad_version_answers']}"
    return (
        f"<tr class='{d.outcome}'><td>{d.id}</td><td>{html.escape(d.scenario)}</td><td>{d.failure_kind}</td>"
        f"<td>{d.started_at:%Y-%m-%d %H:%M:%S}</td><td>{d.outcome}</td><td>{_fmt(d.rto_s)}</td>"
        f"<td>{_fmt((d.slo or {}).get('rto_s'), 0)}</td><td>{_fmt(d.rpo_steps)}</td><td>{_fmt(d.rpo_s)}</td>"
        f"<td>{_fmt(d.loss_max_deviation, 6)}</td><td>{_fmt(d.failed_phase)}</td>"
        f"<td>{_fmt(d.reason)}</td><td class='ph'>{html.escape(phases)}</td><td>{_fmt(d.seed)}</td></tr>"
    )


def _kind_rows(drills: list[Any], real_incidents: list[Any]) -> list[str]:
    """Per failure kind: drills passed, incidents resolved, RTO p50/p95, steps replayed (skipped drills left out)."""
    kinds: dict[str, dict[str, list[Any]]] = defaultdict(lambda: {"drills": [], "incidents": []})
    for d in drills:
        if d.outcome != "skipped":
            kinds[d.failure_kind]["drills"].append(d)
    for i in real_incidents:
        kinds[i.kind]["incidents"].append(i)
    agg = []
    for kind, got in sorted(kinds.items()):
        ds, incs = got["drills"], got["incidents"]
        rtos = [x.rto_s for x in ds + incs if x.rto_s is not None]
        passed = sum(1 for d in ds if d.outcome == "passed")
        replayed = sum(x.rpo_steps or 0 for x in ds) + sum(i.replayed_steps or 0 for i in incs)
        resolved = sum(1 for i in incs if i.resolved_at is not None)
        agg.append(
            f"<tr><td>{kind}</td><td>{len(ds)}</td><td>{passed}/{len(ds) or '-'}</td>"
            f"<td>{resolved}/{len(incs) or '-'}</td><td>{_fmt(statistics.median(rtos) if rtos else None)}</td>"
            f"<td>{_fmt(_pct(rtos, 0.95))}</td><td>{replayed}</td></tr>"
        )
    return agg


def render(drills: list[Any], real_incidents: list[Any]) -> str:
    """The page: aggregates by kind (drills and real incidents), every drill, each failure located."""
    rows = [_drill_row(d) for d in drills]
    agg = _kind_rows(drills, real_incidents)
    plots = "".join(f"<h2>{html.escape(t)}</h2>{img}" for t, img in _plots(drills))
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Rewind recovery drills</title>
<style>
body{{font-family:system-ui,sans-serif;margin:2em;color:#222}} table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:3px 6px;vertical-align:top}} th{{background:#f3f3f3}}
tr.failed td{{background:#fde8e8}} tr.passed td{{background:#eaf7ea}} tr.skipped td{{color:#777}}
td.ph{{font-family:monospace;font-size:12px}} img{{max-width:100%}}
</style></head><body>
<h1>Rewind recovery drills</h1>
<p>{len(drills)} drills ({sum(d.outcome == "passed" for d in drills)} passed,
{sum(d.outcome == "failed" for d in drills)} failed, {sum(d.outcome == "skipped" for d in drills)} skipped),
{len(real_incidents)} real incidents. Written {now}.</p>
<h2>By failure kind (drills and real incidents)</h2>
<table><tr><th>kind</th><th>drills</th><th>drills passed</th><th>incidents resolved</th><th>RTO p50 s</th>
<th>RTO p95 s</th><th>steps replayed</th></tr>{"".join(agg)}</table>
{plots}
<h2>Every drill</h2>
<p>A failed drill names the phase that failed or broke its budget: a phase that did not complete, the first
phase over its own budget, replay over the replay budget, or the longest phase when the RTO was exceeded.</p>
<table><tr><th>id</th><th>scenario</th><th>kind</th><th>started</th><th>outcome</th><th>RTO s</th><th>RTO budget s</th>
<th>RPO steps</th><th>RPO s</th><th>loss max dev.</th><th>failed phase</th><th>why</th><th>phases (s)</th><th>seed</th></tr>
{"".join(rows)}</table>
</body></html>
"""
