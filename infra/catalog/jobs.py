"""Job specs, launches and per-rank progress in the catalog.

Every rank writes its own progress row (one upsert a heartbeat); the supervisor
reads a launch's rows. The catalog is the channel because it is the one place
every node and the supervisor already reach, and it outlives any process of the
job (a rendezvous store dies with the agent that hosts it).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.dialects import postgresql, sqlite

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import JobSpecRow, Launch, RankProgress, utcnow
from rewind.infra.errors import NotFoundError


def set_spec(cat: Catalog, run: str, spec: dict[str, Any]) -> None:
    """Record (or replace) how ``run`` is launched."""
    run_id = lineage.ensure_run(cat, run)
    with cat.session() as s:
        row = s.get(JobSpecRow, run_id)
        if row is None:
            s.add(JobSpecRow(run_id=run_id, spec=spec))
        else:
            row.spec = spec


def get_spec(cat: Catalog, run: str) -> dict[str, Any]:
    run_id = lineage.get_run(cat, run).id
    with cat.session() as s:
        row = s.get(JobSpecRow, run_id)
    if row is None:
        raise NotFoundError(f"run {run!r} has no job spec: start it once with a command (protect-training)")
    return dict(row.spec)


def begin_launch(
    cat: Catalog, run: str, spec: dict[str, Any], handoff: dict[str, Any], incident_id: int | None = None
) -> int:
    run_id = lineage.ensure_run(cat, run)
    with cat.session() as s:
        row = Launch(run_id=run_id, spec=spec, handoff=handoff, incident_id=incident_id)
        s.add(row)
        s.flush()
        return row.id


def set_placement(cat: Catalog, launch_id: int, *, hosts: list[str], allocation: str | None) -> None:
    """Where the launch's nodes run (node 0 first) and the scheduler's job id: kept with what it was handed."""
    with cat.session() as s:
        row = s.get(Launch, launch_id)
        if row is not None:
            row.handoff = {**(row.handoff or {}), "hosts": hosts, "allocation": allocation}


def set_warm(cat: Catalog, launch_id: int, nodes: list[bool]) -> None:
    """Which of the launch's nodes a standby took over (warm), by node: kept with what it was handed."""
    with cat.session() as s:
        row = s.get(Launch, launch_id)
        if row is not None:
            row.handoff = {**(row.handoff or {}), "warm": nodes}


def end_launch(cat: Catalog, launch_id: int, exit_code: int) -> None:
    with cat.session() as s:
        s.execute(update(Launch).where(Launch.id == launch_id).values(exit_code=exit_code, ended_at=utcnow()))


def get_launch(cat: Catalog, launch_id: int) -> Launch:
    return cat.get(Launch, launch_id, "launch")


def launches(cat: Catalog, run: str) -> list[Launch]:
    run_id = lineage.get_run(cat, run).id
    with cat.session() as s:
        return list(s.scalars(select(Launch).where(Launch.run_id == run_id).order_by(Launch.id)))


def report(cat: Catalog, launch_id: int, rank: int, **fields: Any) -> None:
    """Upsert one rank's progress row (``node``, ``pid``, ``step``, ``loss``, ``beat_at``, ...)."""
    values = {"launch_id": launch_id, "rank": rank, **fields}
    dialect = postgresql if cat.engine.dialect.name == "postgresql" else sqlite
    stmt = dialect.insert(RankProgress).values(**values)
    stmt = stmt.on_conflict_do_update(index_elements=["launch_id", "rank"], set_=fields)
    with cat.session() as s:
        s.execute(stmt)


def progress(cat: Catalog, launch_id: int) -> list[RankProgress]:
    with cat.session() as s:
        return list(
            s.scalars(
                select(RankProgress).where(RankProgress.launch_id == launch_id).order_by(RankProgress.rank)
            )
        )
