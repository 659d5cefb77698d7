"""What an operator asks first, from the catalog alone: how much would be lost if a run died now,
where its copies are, what is wrong, and what is being served (``rewind status``).

Per run: the newest verified checkpoint and its age; the recovery point if the job died now (steps
and seconds of training since that checkpoint, up to the newest step a rank reported, where the
run's launches reported progress); copies per tier with the tier's replication lag (its newest
verified copy against the run's newest verified checkpoint); the launch now or last running; open
incidents. Per model: its versions, traffic weights and the checkpoint each came from.
Plain data (JSON-ready): the CLI prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import Select, func, select

from infra.catalog import lineage
from infra.catalog.copies import TIER_ORDER, CopyRow, copy_rows
from infra.catalog.db import Catalog
from infra.catalog.models import (
    Checkpoint,
    Incident,
    Launch,
    RankProgress,
    Run,
    ServingVersion,
    aware,
)
from infra.catalog.models import CheckpointStatus as S
from infra.catalog.models import ReplicaStatus as R

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
    """Every run (or ``run`` alone: NotFoundError if unknown) and every model (or those serving ``run``)."""
    now = now or datetime.now(UTC)
    with cat.session() as s:
        q = select(Run).order_by(Run.created_at, Run.id)
        runs = list(s.scalars(q.where(Run.name == run) if run is not None else q))
    if run is not None and not runs:
        lineage.get_run(cat, run)  # raises NotFoundError with the catalog's name in it
    ids = [r.id for r in runs]
    ckpts = _checkpoints(cat, ids)
    copies = _copies(cat, ids)
    launches = _newest_launches(cat, ids)
    progress = _progress(cat, [launch.id for launch in launches.values()])
    open_incidents = _open_incidents(cat, ids)
    out_runs = [
        _run(r, ckpts.get(r.id, []), copies, launches.get(r.id), progress, open_incidents.get(r.id, []), now)
        for r in runs
    ]
    return {"at": now.isoformat(), "runs": out_runs, "models": _models(cat, run)}


class Ckpt(NamedTuple):
    """A restorable checkpoint as the overview reads it: columns only (every run's, thousands each)."""

    id: int
    run_id: int
    step: int
    status: str
    created_at: datetime
    total_bytes: int | None


def _restorable(run_ids: Sequence[int]) -> Select[Any]:
    return select(Checkpoint.id).where(Checkpoint.run_id.in_(run_ids), Checkpoint.status.in_(RESTORABLE))


def _checkpoints(cat: Catalog, run_ids: Sequence[int]) -> dict[int, list[Ckpt]]:
    out: dict[int, list[Ckpt]] = {}
    if not run_ids:
        return out
    columns = (
        Checkpoint.run_id,
        Checkpoint.step,
        Checkpoint.status,
        Checkpoint.created_at,
        Checkpoint.total_bytes,
    )
    with cat.session() as s:
        rows = s.execute(
            _restorable(run_ids).add_columns(*columns).order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        )
        for c in rows:
            out.setdefault(c.run_id, []).append(Ckpt(*c))
    return out


def _copies(cat: Catalog, run_ids: Sequence[int]) -> dict[int, list[CopyRow]]:
    """Live copies of the runs' verified checkpoints (the only ones the overview counts), in one statement."""
    if not run_ids:
        return {}
    verified = _restorable(run_ids).where(Checkpoint.status == S.VERIFIED.value)
    return copy_rows(cat, verified, statuses=LIVE_COPY)


def _newest_launches(cat: Catalog, run_ids: Sequence[int]) -> dict[int, Launch]:
    if not run_ids:
        return {}
    with cat.session() as s:
        newest = (
            select(func.max(Launch.id))
            .where(Launch.run_id.in_(run_ids))
            .group_by(Launch.run_id)
            .scalar_subquery()
        )
        return {launch.run_id: launch for launch in s.scalars(select(Launch).where(Launch.id.in_(newest)))}


def _progress(cat: Catalog, launch_ids: Sequence[int]) -> dict[int, list[RankProgress]]:
    out: dict[int, list[RankProgress]] = {}
    if not launch_ids:
        return out
    with cat.session() as s:
        for p in s.scalars(select(RankProgress).where(RankProgress.launch_id.in_(launch_ids))):
            out.setdefault(p.launch_id, []).append(p)
    return out


def _open_incidents(cat: Catalog, run_ids: Sequence[int]) -> dict[int, list[Incident]]:
    out: dict[int, list[Incident]] = {}
    if not run_ids:
        return out
    with cat.session() as s:
        rows = s.scalars(
            select(Incident)
            .where(Incident.run_id.in_(run_ids), Incident.resolved_at.is_(None))
            .order_by(Incident.id)
        )
        for i in rows:
            out.setdefault(i.run_id, []).append(i)
    return out


def _run(
    run: Run,
    ckpts: list[Ckpt],
    copies: dict[int, list[CopyRow]],
    launch: Launch | None,
    progress: dict[int, list[RankProgress]],
    incidents: list[Incident],
    now: datetime,
) -> dict[str, Any]:
    verified = [c for c in ckpts if c.status == S.VERIFIED.value]
    newest = verified[0] if verified else None
    # committed after the newest verified one, not yet proven
    unproven = next((c for c in ckpts if newest is None or c.step > newest.step), None)
    ranks = progress.get(launch.id, []) if launch is not None else []
    stepped = [p for p in ranks if p.step is not None]
    last = max(stepped, key=lambda p: (p.step or 0, p.step_at or 0.0), default=None)
    rpo: dict[str, Any] = {"steps": None, "seconds": None, "to_step": None}
    if last is not None and last.step is not None:
        rpo["to_step"] = last.step
        base_step = newest.step if newest is not None else 0
        rpo["steps"] = max(0, last.step - base_step)
        if (
            newest is not None
            and last.step_at is not None
            and (made := _aware(newest.created_at)) is not None
        ):
            rpo["seconds"] = round(max(0.0, last.step_at - made.timestamp()), 3)
    return {
        "run": run.name,
        "created_at": _iso(run.created_at),
        "newest_verified": None if newest is None else _ckpt(newest, now),
        "newest_unverified": None if unproven is None else _ckpt(unproven, now),
        "verified_checkpoints": len(verified),
        "rpo": rpo,
        "job": _job(launch, ranks, now),
        "tiers": _tiers(verified, copies, newest),
        "open_incidents": [
            {
                "id": i.id,
                "kind": i.kind,
                "detected_at": _iso(i.detected_at),
                "age_s": _age(i.detected_at, now),
                "reason": i.reason,
            }
            for i in incidents
        ],
    }


def _ckpt(c: Ckpt, now: datetime) -> dict[str, Any]:
    return {
        "step": c.step,
        "checkpoint_id": c.id,
        "status": c.status,
        "created_at": _iso(c.created_at),
        "age_s": _age(c.created_at, now),
        "bytes": c.total_bytes,
    }


def _job(launch: Launch | None, ranks: list[RankProgress], now: datetime) -> dict[str, Any] | None:
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
    }


def _tiers(verified: list[Ckpt], copies: dict[int, list[CopyRow]], newest: Ckpt | None) -> dict[str, Any]:
    """Per tier: copies of verified checkpoints (by status), bytes, and how far the tier lags behind."""
    tiers: dict[str, dict[str, Any]] = {}
    for c in verified:  # newest first
        for r in copies.get(c.id, []):
            t = tiers.setdefault(
                r.tier, {"copies": 0, "verified_copies": 0, "bytes": 0, "newest_verified_step": None}
            )
            t["copies"] += 1
            t["bytes"] += r.bytes or 0
            if r.status == R.VERIFIED.value:
                t["verified_copies"] += 1
                if t["newest_verified_step"] is None:
                    t["newest_verified_step"] = c.step
                    t["_at"] = _aware(c.created_at)
    for t in tiers.values():
        at = t.pop("_at", None)
        if newest is None or t["newest_verified_step"] is None:
            t["lag_steps"] = t["lag_s"] = None
            continue
        t["lag_steps"] = newest.step - t["newest_verified_step"]
        made = _aware(newest.created_at)
        t["lag_s"] = round((made - at).total_seconds(), 3) if made is not None and at is not None else None
    return dict(sorted(tiers.items(), key=lambda kv: TIER_ORDER.get(kv[0], 9)))


def _models(cat: Catalog, run: str | None) -> list[dict[str, Any]]:
    with cat.session() as s:
        q = select(ServingVersion).order_by(ServingVersion.model, ServingVersion.id)
        versions = list(s.scalars(q.where(ServingVersion.run == run) if run is not None else q))
        ids = [v.checkpoint_id for v in versions if v.checkpoint_id is not None]
        source = (
            {c.id: c.status for c in s.scalars(select(Checkpoint).where(Checkpoint.id.in_(ids)))}
            if ids
            else {}
        )
    models: dict[str, list[dict[str, Any]]] = {}
    for v in versions:
        models.setdefault(v.model, []).append(
            {
                "version": v.version,
                "state": v.state,
                "weight": v.weight,
                "run": v.run,
                "step": v.step,
                "checkpoint_id": v.checkpoint_id,
                "checkpoint_status": source.get(v.checkpoint_id) if v.checkpoint_id is not None else None,
                "manifest_digest": v.manifest_digest,
                "created_at": _iso(v.created_at),
            }
        )
    return [{"model": m, "versions": vs} for m, vs in models.items()]
