"""Incidents: one row per detected failure, filled in as recovery proceeds."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Incident, utcnow
from infra.errors import ConfigError, NotFoundError

KINDS = ("crash", "failed_to_start", "hang", "nan", "loss_spike", "gpu", "manual")  # at most 16 characters


def open_incident(
    cat: Catalog, run: str, kind: str, reason: str, *, origin: str | None = None, **fields: Any
) -> int:
    """A new incident, or, when one with this ``origin`` exists (a retried task), that one."""
    if kind not in KINDS:
        raise ConfigError(f"incident kind {kind!r} is not one of {KINDS}")
    run_id = lineage.get_run(cat, run).id
    if origin is not None and (known := _by_origin(cat, origin)) is not None:
        return known
    try:
        with cat.session() as s:
            inc = Incident(run_id=run_id, kind=kind, reason=reason, origin=origin, **fields)
            s.add(inc)
            s.flush()
            return inc.id
    except IntegrityError:  # the same record made concurrently
        known = _by_origin(cat, str(origin))
        if known is None:
            raise
        return known


def _by_origin(cat: Catalog, origin: str) -> int | None:
    with cat.session() as s:
        return s.scalar(select(Incident.id).where(Incident.origin == origin))


def announced(cat: Catalog, incident_id: int) -> bool:
    """Has the incident's failure event gone out? (Emitted, then marked: at least once, never lost;
    a second delivery finds the recovery already claimed.)"""
    with cat.session() as s:
        return s.scalar(select(Incident.announced_at).where(Incident.id == incident_id)) is not None


def mark_announced(cat: Catalog, incident_id: int) -> None:
    with cat.session() as s:
        s.execute(update(Incident).where(Incident.id == incident_id).values(announced_at=utcnow()))


def claim_recovery(cat: Catalog, incident_id: int, flow_run: str) -> str:
    """Make ``flow_run`` the one recovery of this incident; returns who holds it (itself, or another)."""
    with cat.session() as s:
        s.execute(
            update(Incident)
            .where(Incident.id == incident_id, Incident.recovered_by.is_(None))
            .values(recovered_by=flow_run)
        )
    with cat.session() as s:
        return str(s.scalar(select(Incident.recovered_by).where(Incident.id == incident_id)))


def update_incident(
    cat: Catalog, incident_id: int, *, details: dict[str, Any] | None = None, **fields: Any
) -> None:
    """Set columns; ``details`` keys are merged into the JSON column, not replacing it."""
    with cat.session() as s:
        inc = s.get(Incident, incident_id, with_for_update=True)
        if inc is None:
            raise NotFoundError(f"no incident {incident_id}")
        for k, v in fields.items():
            setattr(inc, k, v)
        if details:
            inc.details = {**(inc.details or {}), **details}


def get_incident(cat: Catalog, incident_id: int) -> Incident:
    return cat.get(Incident, incident_id, "incident")


def incidents_of(cat: Catalog, run: str) -> list[Incident]:
    run_id = lineage.get_run(cat, run).id
    with cat.session() as s:
        return list(s.scalars(select(Incident).where(Incident.run_id == run_id).order_by(Incident.id)))


def recent_count(cat: Catalog, run: str, within_s: float) -> int:
    run_id = lineage.get_run(cat, run).id
    since = utcnow().timestamp() - within_s
    with cat.session() as s:
        rows = s.scalars(select(Incident.detected_at).where(Incident.run_id == run_id)).all()
    return sum(1 for t in rows if t.timestamp() >= since)


def resolve(cat: Catalog, incident_id: int) -> None:
    with cat.session() as s:
        s.execute(update(Incident).where(Incident.id == incident_id).values(resolved_at=func.now()))
