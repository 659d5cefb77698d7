"""What an operator asks first, from the catalog alone: how much would be lost if a run died now,
where its copies are, what is wrong, and what is being served (``rewind status``).

Per run: the newest verified checkpoint and its age (and its save's stall); the recovery point if the job died now (steps
and seconds of training since that checkpoint, up to the newest step a rank reported, where the
run's launches reported progress); copies per tier with the tier's replication lag (its newest
verified copy against the run's newest verified checkpoint); the launch now or last running; open
incidents. Per model: its versions, traffic weights and the checkpoint each came from.
Plain data (JSON-ready): the CLI prints it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import Select, and_, case, func, select

from rewind.infra import config
from rewind.infra.catalog import lineage
from rewind.infra.catalog.copies import TIER_ORDER
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import (
    Checkpoint,
    Incident,
    Launch,
    RankProgress,
    Replica,
    Run,
    ServingVersion,
    aware,
)
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R

RESTORABLE = (S.COMMITTED.value, S.VERIFIED.value)
LIVE_COPY = (R.PENDING.value, R.VERIFIED.value, R.UNVERIFIABLE.value)  # a copy that is there


def _aware(ts: datetime | None) -> datetime | None:
    return None if ts is None else aware(ts)


def _age(ts: datetime | None, now: datetime) -> float | None:
    t = _aware(ts)
    return None if t is None else round((now - t).total_seconds(), 3)


def _iso(ts: datetime | None) -> str | None:
    return lineage.iso(_aware(ts))


def status(cat: Catalog, run: str | None = None, *, now: datetime | None = None) -> dict[str, Any]:
    """Every run (or ``run`` alone: NotFoundError if unknown) and every model (or those serving ``run``).

    A fixed number of statements whatever the catalog holds: totals, newest checkpoints and tier lags
    are computed in SQL (a catalog of 100,000 checkpoints has ~300,000 copy rows, too many to read).
    """
    now = now or datetime.now(UTC)
    wanted = select(Run.id) if run is None else select(Run.id).where(Run.name == run)
    with cat.session() as s:
        q = select(Run).order_by(Run.created_at, Run.id)
        runs = list(s.scalars(q.where(Run.name == run) if run is not None else q))
    if run is not None and not runs:
        lineage.get_run(cat, run)  # raises NotFoundError with the catalog's name in it
    newest = _newest(cat, wanted)
    tiers = _tier_rows(cat, wanted)
    launches = _newest_launches(cat, wanted)
    progress = _progress(cat, wanted)
    open_incidents = _open_incidents(cat, wanted)
    out_runs = [
        _run(r, newest.get(r.id), tiers.get(r.id, []), launches.get(r.id), progress, open_incidents, now)
        for r in runs
    ]
    return {"at": now.isoformat(), "runs": out_runs, "models": _models(cat, run)}


class Ckpt(NamedTuple):
    """A restorable checkpoint as the overview reads it: columns only."""

    id: int
    run_id: int
    step: int
    status: str
    created_at: datetime
    total_bytes: int | None
    save_stall_s: float | None  # how long its save held training up


class Newest(NamedTuple):
    """A run's newest verified checkpoint, its newest restorable one (either status), how many are verified."""

    verified: Ckpt | None
    top: Ckpt
    verified_count: int


class TierRow(NamedTuple):
    """Copies of a run's verified checkpoints on one tier, totalled in SQL."""

    tier: str
    copies: int
    verified_copies: int
    bytes: int
    newest_step: int  # the newest checkpoint with a copy here: orders tiers TIER_ORDER lacks
    verified_step: int | None  # the newest checkpoint with a verified copy here
    verified_at: datetime | None  # ... and when it was made


def _newest(cat: Catalog, wanted: Select[Any]) -> dict[int, Newest]:
    """Per run, the newest committed and the newest verified checkpoint and how many there are: one
    statement, at most two rows per run, not every checkpoint. Grouped (a hash, no sort of 100,000 rows),
    then joined back by step: a run has one live checkpoint per step, so the newest step names one row."""
    totals = (
        select(
            Checkpoint.run_id,
            Checkpoint.status,
            func.max(Checkpoint.step).label("step"),
            func.count().label("n"),
        )
        .where(Checkpoint.run_id.in_(wanted.scalar_subquery()), Checkpoint.status.in_(RESTORABLE))
        .group_by(Checkpoint.run_id, Checkpoint.status)
        .subquery()
    )
    q = select(
        Checkpoint.id,
        Checkpoint.run_id,
        Checkpoint.step,
        Checkpoint.status,
        Checkpoint.created_at,
        Checkpoint.total_bytes,
        Checkpoint.save_stall_s,
        totals.c.n,
    ).join(
        totals,
        and_(
            Checkpoint.run_id == totals.c.run_id,
            Checkpoint.step == totals.c.step,
            Checkpoint.status == totals.c.status,
        ),
    )
    tops: dict[int, list[tuple[Ckpt, int]]] = {}
    with cat.session() as s:
        for row in s.execute(q):
            tops.setdefault(row.run_id, []).append((Ckpt(*row[:7]), int(row.n)))
    out = {}
    for run_id, found in tops.items():
        verified = next(((c, n) for c, n in found if c.status == S.VERIFIED.value), None)
        top = max((c for c, _ in found), key=lambda c: (c.step, c.id))
        out[run_id] = Newest(verified[0] if verified else None, top, verified[1] if verified else 0)
    return out


def _tier_rows(cat: Catalog, wanted: Select[Any]) -> dict[int, list[TierRow]]:
    """Per run and tier, the live copies of verified checkpoints (the only ones the overview counts):
    counts, bytes and the newest verified copy's checkpoint, one row each, totalled in the database
    (grouped, then the newest verified copy's checkpoint joined back by its step, as in :func:`_newest`)."""
    verified_copy = Replica.status == R.VERIFIED.value
    totals = (
        select(
            Checkpoint.run_id,
            Replica.tier,
            func.count().label("copies"),
            func.sum(case((verified_copy, 1), else_=0)).label("verified_copies"),
            func.sum(func.coalesce(Replica.bytes, 0)).label("bytes"),
            func.max(Checkpoint.step).label("newest_step"),
            func.max(case((verified_copy, Checkpoint.step))).label("verified_step"),
        )
        .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
        .where(
            Checkpoint.run_id.in_(wanted.scalar_subquery()),
            Checkpoint.status == S.VERIFIED.value,
            Replica.status.in_(LIVE_COPY),
        )
        .group_by(Checkpoint.run_id, Replica.tier)
        .subquery()
    )
    made = (
        select(Checkpoint.created_at)
        .where(
            Checkpoint.run_id == totals.c.run_id,
            Checkpoint.step == totals.c.verified_step,
            Checkpoint.status == S.VERIFIED.value,
        )
        .scalar_subquery()
    )
    out: dict[int, list[TierRow]] = {}
    with cat.session() as s:
        for r in s.execute(select(totals, made.label("verified_at"))):
            row = TierRow(
                r.tier, int(r.copies), int(r.verified_copies), int(r.bytes), int(r.newest_step),
                r.verified_step, r.verified_at,
            )  # fmt: skip
            out.setdefault(r.run_id, []).append(row)
    return out


def _newest_launches(cat: Catalog, wanted: Select[Any]) -> dict[int, Launch]:
    with cat.session() as s:
        return {
            launch.run_id: launch
            for launch in s.scalars(select(Launch).where(Launch.id.in_(_newest_launch(wanted))))
        }


def _newest_launch(wanted: Select[Any]) -> Any:
    """The id of each wanted run's newest launch, as a subquery (no id list bound)."""
    return (
        select(func.max(Launch.id))
        .where(Launch.run_id.in_(wanted.scalar_subquery()))
        .group_by(Launch.run_id)
        .scalar_subquery()
    )


def _progress(cat: Catalog, wanted: Select[Any]) -> dict[int, list[RankProgress]]:
    """What the ranks of each run's newest launch reported, keyed by launch."""
    out: dict[int, list[RankProgress]] = {}
    with cat.session() as s:
        for p in s.scalars(select(RankProgress).where(RankProgress.launch_id.in_(_newest_launch(wanted)))):
            out.setdefault(p.launch_id, []).append(p)
    return out


def _open_incidents(cat: Catalog, wanted: Select[Any]) -> dict[int, list[Incident]]:
    out: dict[int, list[Incident]] = {}
    with cat.session() as s:
        rows = s.scalars(
            select(Incident)
            .where(Incident.run_id.in_(wanted.scalar_subquery()), Incident.resolved_at.is_(None))
            .order_by(Incident.id)
        )
        for i in rows:
            out.setdefault(i.run_id, []).append(i)
    return out


def _run(
    run: Run,
    newest: Newest | None,
    tiers: list[TierRow],
    launch: Launch | None,
    progress: dict[int, list[RankProgress]],
    incidents: dict[int, list[Incident]],
    now: datetime,
) -> dict[str, Any]:
    verified = newest.verified if newest is not None else None
    # committed after the newest verified one, not yet proven
    unproven = (
        newest.top if newest is not None and (verified is None or newest.top.step > verified.step) else None
    )
    ranks = progress.get(launch.id, []) if launch is not None else []
    return {
        "run": run.name,
        "created_at": _iso(run.created_at),
        "newest_verified": None if verified is None else _ckpt(verified, now),
        "newest_unverified": None if unproven is None else _ckpt(unproven, now),
        "verified_checkpoints": newest.verified_count if newest is not None else 0,
        "rpo": _rpo(verified, ranks),
        "job": _job(run.name, launch, ranks, now),
        "tiers": _tiers(tiers, verified),
        "open_incidents": [
            {
                "id": i.id,
                "kind": i.kind,
                "detected_at": _iso(i.detected_at),
                "age_s": _age(i.detected_at, now),
                "reason": i.reason,
            }
            for i in incidents.get(run.id, [])
        ],
    }


def _rpo(newest: Ckpt | None, ranks: list[RankProgress]) -> dict[str, Any]:
    """Steps and seconds of training since ``newest``, up to the newest step a rank reported."""
    stepped = [p for p in ranks if p.step is not None]
    last = max(stepped, key=lambda p: (p.step or 0, p.step_at or 0.0), default=None)
    rpo: dict[str, Any] = {"steps": None, "seconds": None, "to_step": None}
    if last is not None and last.step is not None:
        rpo["to_step"] = last.step
        base_step = newest.step if newest is not None else 0
        rpo["steps"] = max(0, last.step - base_step)
        if rpo["steps"] == 0:
            rpo["seconds"] = 0.0  # the newest reported step is in the checkpoint: nothing of it is at risk
        elif (
            newest is not None
            and last.step_at is not None
            and (made := _aware(newest.created_at)) is not None
        ):
            rpo["seconds"] = round(max(0.0, last.step_at - made.timestamp()), 3)
    return rpo


def _ckpt(c: Ckpt, now: datetime) -> dict[str, Any]:
    return {
        "step": c.step,
        "checkpoint_id": c.id,
        "status": c.status,
        "created_at": _iso(c.created_at),
        "age_s": _age(c.created_at, now),
        "bytes": c.total_bytes,
        "save_stall_s": None if c.save_stall_s is None else round(c.save_stall_s, 4),
    }


def _job(run: str, launch: Launch | None, ranks: list[RankProgress], now: datetime) -> dict[str, Any] | None:
    if launch is None:
        return None
    beats = [p.beat_at for p in ranks]
    return {
        "launch_id": launch.id,
        "running": launch.ended_at is None,
        "exit_code": launch.exit_code,
        "started_at": _iso(launch.started_at),
        "ended_at": _iso(launch.ended_at),
        "ranks": len(ranks),
        "last_report_age_s": round(now.timestamp() - max(beats), 3) if beats else None,
        # each rank's process as it reported itself: what to `kill` to drill a crash by hand
        "processes": []
        if launch.ended_at is not None  # an ended launch's PIDs may name other processes by now
        else [{"rank": p.rank, "node": p.node, "pid": p.pid} for p in sorted(ranks, key=_by_rank)],
        "log_dir": str(config.job_log_dir(run, launch.id)),  # on the machine that supervised it
    }


def _by_rank(p: RankProgress) -> int:
    return p.rank


def _tiers(rows: list[TierRow], newest: Ckpt | None) -> dict[str, Any]:
    """Per tier: copies of verified checkpoints (by status), bytes, and how far the tier lags behind."""
    tiers: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: (TIER_ORDER.get(r.tier, 9), -r.newest_step, r.tier)):
        t = tiers[r.tier] = {
            "copies": r.copies,
            "verified_copies": r.verified_copies,
            "bytes": r.bytes,
            "newest_verified_step": r.verified_step,
        }
        if newest is None or r.verified_step is None:
            t["lag_steps"] = t["lag_s"] = None
            continue
        t["lag_steps"] = newest.step - r.verified_step
        made, at = _aware(newest.created_at), _aware(r.verified_at)
        t["lag_s"] = round((made - at).total_seconds(), 3) if made is not None and at is not None else None
    return tiers


def _models(cat: Catalog, run: str | None) -> list[dict[str, Any]]:
    with cat.session() as s:  # each version with its checkpoint's status now (None: the row is gone)
        q = (
            select(ServingVersion, Checkpoint.status)
            .outerjoin(Checkpoint, Checkpoint.id == ServingVersion.checkpoint_id)
            .order_by(ServingVersion.model, ServingVersion.id)
        )
        rows = list(s.execute(q.where(ServingVersion.run == run) if run is not None else q).all())
    models: dict[str, list[dict[str, Any]]] = {}
    for v, checkpoint_status in rows:
        models.setdefault(v.model, []).append(
            {
                "version": v.version,
                "state": v.state,
                "weight": v.weight,
                "run": v.run,
                "step": v.step,
                "checkpoint_id": v.checkpoint_id,
                "checkpoint_status": checkpoint_status,
                "manifest_digest": v.manifest_digest,
                "created_at": _iso(v.created_at),
            }
        )
    return [{"model": m, "versions": vs} for m, vs in models.items()]
