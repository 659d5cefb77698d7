"""Drill rows: what each recovery drill measured and why it passed or failed."""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import func, select

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Drill, DrillOutcome, utcnow

OUTCOMES = tuple(o.value for o in DrillOutcome)


def record(cat: Catalog, **fields: Any) -> int:
    from rewind.infra.errors import ConfigError

    if fields.get("outcome") not in OUTCOMES:
        raise ConfigError(f"drill outcome {fields.get('outcome')!r} is not one of {OUTCOMES}")
    fields.setdefault("ended_at", utcnow())
    fields.setdefault("phases", {})
    fields.setdefault("details", {})
    with cat.session() as s:
        row = Drill(**fields)
        s.add(row)
        s.flush()
        return row.id


def get(cat: Catalog, drill_id: int) -> Drill:
    return cat.get(Drill, drill_id, "drill")


def all_drills(cat: Catalog, scenario: str | None = None) -> list[Drill]:
    with cat.session() as s:
        q = select(Drill).order_by(Drill.id)
        if scenario is not None:
            q = q.where(Drill.scenario == scenario)
        return list(s.scalars(q))


class ScenarioTotals(NamedTuple):
    """The drills of one scenario: how many ended each way, and what the newest one found."""

    scenario: str
    outcomes: dict[str, int]  # every outcome, 0 where none ended so
    last_outcome: str
    last_rto_s: float | None
    last_at: datetime  # when the newest one ended (or started, if it never said)


def totals_by_scenario(cat: Catalog) -> list[ScenarioTotals]:
    """Per scenario, totalled in SQL (two statements whatever the catalog holds): the metrics read this."""
    counts = select(Drill.scenario, Drill.outcome, func.count()).group_by(Drill.scenario, Drill.outcome)
    newest = select(func.max(Drill.id)).group_by(Drill.scenario)
    out: dict[str, dict[str, int]] = {}
    with cat.session() as s:
        for scenario, outcome, n in s.execute(counts):
            out.setdefault(scenario, dict.fromkeys(OUTCOMES, 0))[str(outcome)] = int(n)
        last = {d.scenario: d for d in s.scalars(select(Drill).where(Drill.id.in_(newest)))}
    return [
        ScenarioTotals(name, outcomes, str(d.outcome), d.rto_s, d.ended_at or d.started_at)
        for name, outcomes in sorted(out.items())
        if (d := last.get(name)) is not None
    ]
