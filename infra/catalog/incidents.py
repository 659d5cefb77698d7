"""Incidents: one row per detected failure, filled in as recovery proceeds."""

from __future__ import annotations

from typing import Any, NamedTuple

from sqlalchemy import case, func, select, update
from sqlalchemy.exc import IntegrityError

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Incident, IncidentKind, utcnow
from rewind.infra.errors import ConfigError, NotFoundError

# What an incident can be: every kind but FINISHED (a launch that ended well is no incident).
KINDS = tuple(k.value for k in IncidentKind if k is not IncidentKind.FINISHED)


def open_incident(
    cat: Catalog, run: str, kind: str, reason: str, *, origin: str | None = None, **fields: Any
) -> int:
    """A new incident, or, when one with this ``origin`` exists (a retried task), that one."""
    if kind not in KINDS:
        raise ConfigError(f"incident kind {str(kind)!r} is not one of {KINDS}")
    run_id = lineage.get_run(cat, run).id
    if origin is not None and (known := _by_origin(cat, origin)) is not None:
        return known
    try:
        with cat.session() as s:
            inc = Incident(run_id=run_id, kind=IncidentKind(kind), reason=reason, origin=origin, **fields)
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


class KindTotals(NamedTuple):
    """Every incident of one kind, totalled: how many, how many still open, and their RTO."""

    kind: str
    incidents: int
    open: int
    measured: int  # incidents with an RTO recorded
    rto_sum_s: float
    last_rto_s: float | None  # the newest measured incident's


def totals_by_kind(cat: Catalog) -> list[KindTotals]:
    """Per kind, totalled in SQL (two statements whatever the catalog holds): the metrics read this."""
    totals = (
        select(
            Incident.kind,
            func.count().label("n"),
            func.sum(case((Incident.resolved_at.is_(None), 1), else_=0)).label("open"),
            func.count(Incident.rto_s).label("measured"),
            func.coalesce(func.sum(Incident.rto_s), 0.0).label("rto_sum"),
        )
        .group_by(Incident.kind)
        .order_by(Incident.kind)
    )
    newest = select(func.max(Incident.id)).where(Incident.rto_s.is_not(None)).group_by(Incident.kind)
    last_rto = select(Incident.kind, Incident.rto_s).where(Incident.id.in_(newest))
    with cat.session() as s:
        last = {kind: rto for kind, rto in s.execute(last_rto)}
        rows = list(s.execute(totals))
    return [
        KindTotals(str(r.kind), int(r.n), int(r.open), int(r.measured), float(r.rto_sum), last.get(r.kind))
        for r in rows
    ]
