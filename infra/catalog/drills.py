"""Drill rows: what each recovery drill measured and why it passed or failed."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select

from infra.catalog.db import Catalog
from infra.catalog.models import Drill, utcnow

OUTCOMES = ("passed", "failed", "skipped")


def record(cat: Catalog, **fields: Any) -> int:
    from infra.errors import ConfigError

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
