"""Copies of checkpoints (one ``replica`` row per copy, on any tier) and what their checks found.

Findings belong to copies. A checkpoint's own status follows from its copies in
one guarded statement (:func:`settle`): it is verified as soon as one copy is,
and corrupt only when no copy is left that could verify. An unverifiable copy
(an I/O error, a key this process lacks) keeps the checkpoint as it was.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Select, and_, case, func, or_, select, update

from rewind.infra.catalog import disks, lineage, locations
from rewind.infra.catalog.db import Catalog, changed, chunks
from rewind.infra.catalog.models import Checkpoint, Replica, Run, utcnow
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format.local_tier import LocalTier

LOCAL, MEMORY = disks.LOCAL, disks.MEMORY
TIER_ORDER = {MEMORY: 0, LOCAL: 1, "shared": 2, "offsite": 3}  # nearest first
USABLE = (R.PENDING, R.VERIFIED, R.UNVERIFIABLE)  # a copy worth trying
GONE = (R.CORRUPT, R.MISSING, R.DELETED)
CONTENT_REASON = "content: "  # a checkpoint condemned for its content: no copy can save it
USABLE_VALUES = frozenset(u.value for u in USABLE)


class CopyRow(NamedTuple):
    """One copy as planners read it: plain columns, no ORM object."""

    replica_id: int
    checkpoint_id: int
    tier: str
    uri: str
    key: str | None
    status: str
    bytes: int | None
    tier_id: str | None = None
    host: str | None = None


def copies_of(cat: Catalog, checkpoint_ids: Iterable[int]) -> dict[int, list[Replica]]:
    """Every copy of each checkpoint, nearest tier first (ids bound in chunks: Postgres takes at most
    65,535 parameters a statement; a caller with a whole run to read should select by subquery instead)."""
    ids = list(checkpoint_ids)
    out: dict[int, list[Replica]] = {i: [] for i in ids}
    with cat.session() as s:
        for batch in chunks(ids):
            for r in s.scalars(select(Replica).where(Replica.checkpoint_id.in_(batch)).order_by(Replica.id)):
                out[r.checkpoint_id].append(r)
    for reps in out.values():
        reps.sort(key=lambda r: TIER_ORDER.get(r.tier, 9))
    return out


def copy_rows(
    cat: Catalog, checkpoint_ids: Select[Any], statuses: Collection[str] | None = None
) -> dict[int, list[CopyRow]]:
    """The copies (in ``statuses``, default all) of the checkpoints ``checkpoint_ids`` selects, nearest tier
    first, keyed by checkpoint (absent: no such copy).

    One statement whatever the number of checkpoints: the ids stay in the database as a subquery (a bound
    parameter per id would meet Postgres's limit of 65,535 on a large run), and rows are tuples, not
    ORM objects, because a planner reads thousands of them.
    """
    q = select(
        Replica.id,
        Replica.checkpoint_id,
        Replica.tier,
        Replica.uri,
        Replica.key,
        Replica.status,
        Replica.bytes,
        Replica.tier_id,
        Replica.host,
    ).where(Replica.checkpoint_id.in_(checkpoint_ids.scalar_subquery()))
    if statuses is not None:
        q = q.where(Replica.status.in_(list(statuses)))
    out: dict[int, list[CopyRow]] = {}
    with cat.session() as s:
        for row in s.execute(q.order_by(Replica.id)):
            out.setdefault(row.checkpoint_id, []).append(CopyRow(*row))
    for reps in out.values():
        reps.sort(key=lambda r: TIER_ORDER.get(r.tier, 9))
    return out


class Checkable(NamedTuple):
    """A checkpoint a scrub checks, and how long ago its copies were: ``never`` when one of them has not
    been checked yet, else ``oldest``, the earliest of its copies' last checks."""

    id: int
    step: int
    never: bool
    oldest: datetime | None


def worth_checking(cat: Catalog, run_id: int) -> list[Checkable]:
    """The run's checkpoints a scrub checks, in step order: committed, verified, and corrupt ones with a
    usable copy left that are not condemned for their content (a copy may still prove them). Deleted
    copies do not count towards when it was last checked: no scrub looks at them again.

    One statement for any length of run: the usable copy is an EXISTS, not a parameter per checkpoint.
    """
    usable = (
        select(Replica.id)
        .where(Replica.checkpoint_id == Checkpoint.id, Replica.status.in_(sorted(USABLE_VALUES)))
        .exists()
    )
    live = and_(Replica.checkpoint_id == Checkpoint.id, Replica.status != R.DELETED.value)
    oldest = select(func.min(Replica.checked_at)).where(live).scalar_subquery()
    never = select(Replica.id).where(live, Replica.checked_at.is_(None)).exists()
    q = (
        select(Checkpoint.id, Checkpoint.step, Checkpoint.status, Checkpoint.status_reason, never, oldest)
        .where(
            Checkpoint.run_id == run_id,
            or_(
                Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value]),
                and_(Checkpoint.status == S.CORRUPT.value, usable),
            ),
        )
        .order_by(Checkpoint.step, Checkpoint.id)
    )
    with cat.session() as s:
        rows = s.execute(q).all()
    return [
        Checkable(i, step, bool(n), at)
        for i, step, status, reason, n, at in rows
        if not is_condemned(status, reason)
    ]


def add(
    cat: Catalog,
    checkpoint_id: int,
    tier: str,
    uri: str,
    *,
    key: str | None,
    nbytes: int,
    status: R,
    disk: LocalTier | None = None,
    segments: str | None = None,
) -> int:
    """Register a copy (or update the row of the same copy); returns its id. ``disk``: the local disk
    that holds it, as the process that wrote it there said (another host's); else as seen here.
    ``segments``: its files' segment digests as they were written (``rewind.infra.format.segments``)."""
    now = utcnow()
    with cat.session() as s:
        # the same directory name on another disk is another copy (node-local disks share paths)
        tier_id, host = (disk.id, disk.host) if disk is not None else disks.place(tier, uri)
        q = select(Replica).where(
            Replica.checkpoint_id == checkpoint_id, Replica.tier == tier, Replica.uri == uri
        )
        if tier in disks.DIRECTORY_TIERS:
            q = q.where(disks.this_disk(uri) if disk is None else Replica.tier_id == disk.id)
        row = s.scalar(q.limit(1))
        if row is None:
            row = Replica(checkpoint_id=checkpoint_id, tier=tier, uri=uri, key=key, bytes=nbytes)
            s.add(row)
        row.tier_id, row.host = tier_id, host
        row.key, row.bytes, row.status, row.checked_at, row.detail = key, nbytes, status, now, None
        row.segments = segments  # of the bytes just registered: never an earlier copy's
        if status is R.VERIFIED:
            row.verified_at = now
        s.flush()
        return row.id


def segments_of(cat: Catalog, replica_id: int, limit: int) -> str | None:
    """The segment digests recorded with a copy (JSON), None where none were or the record is longer than
    ``limit`` characters (not read)."""
    with cat.session() as s:
        return s.scalar(
            select(Replica.segments).where(Replica.id == replica_id, func.length(Replica.segments) <= limit)
        )


def record(
    cat: Catalog, replica_id: int, status: R, detail: str | None = None, *, uri: str | None = None
) -> None:
    """What a check of one copy found (and, for a local copy moved aside, where it lies now)."""
    now = utcnow()
    values: dict[str, object] = {"status": status.value, "detail": detail, "checked_at": now}
    if status is R.VERIFIED:
        values["verified_at"] = now
    if status in (R.DELETED, R.CORRUPT, R.MISSING):
        values["segments"] = None  # of bytes gone or not to be read again
    if uri is not None:
        values["uri"] = uri
    with cat.session() as s:
        s.execute(update(Replica).where(Replica.id == replica_id).values(**values))


def set_local(cat: Catalog, checkpoint_id: int, path: str, status: R, nbytes: int) -> int:
    """Point the checkpoint's one local copy at ``path`` (a fresh copy fetched from another tier)."""
    with cat.session() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(path=path))
        row = s.scalar(  # this disk's copy; another disk's copy of it keeps its own row
            select(Replica)
            .where(Replica.checkpoint_id == checkpoint_id, Replica.tier == LOCAL, disks.this_disk(path))
            .limit(1)
        )
        rid = row.id if row is not None else None
    if rid is None:
        return add(cat, checkpoint_id, LOCAL, path, key=None, nbytes=nbytes, status=status)
    record(cat, rid, status, uri=path)
    tier_id, host = disks.place(LOCAL, path)
    with cat.session() as s:  # a row from before 0012 learns its disk
        s.execute(update(Replica).where(Replica.id == rid).values(tier_id=tier_id, host=host))
    return rid


def condemned(ck: Checkpoint) -> bool:
    """Corrupt for its content (not for its copies): nothing a copy shows can make it restorable."""
    return is_condemned(ck.status, ck.status_reason)


def is_condemned(status: str, reason: str | None) -> bool:
    """:func:`condemned` from the two columns, for planners that read columns, not rows."""
    return status == S.CORRUPT.value and (reason or "").startswith(CONTENT_REASON)


def settle(cat: Catalog, checkpoint_id: int) -> str:
    """Bring the checkpoint's status in line with its copies; returns the status it has now."""
    with cat.session() as s:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            return S.DELETED.value
        lineage.lock_run(s, ck.run_id)  # retention counts verified checkpoints under the same lock
        s.refresh(ck)
        reps = s.scalars(select(Replica).where(Replica.checkpoint_id == checkpoint_id)).all()
        # a volatile copy (memory) restores while it lasts, but never proves a checkpoint nor condemns it
        alive = [r for r in reps if r.status != R.DELETED.value and r.tier not in disks.VOLATILE_TIERS]
        one_good = any(r.status == R.VERIFIED.value for r in alive)
        none_left = all(r.status in (R.CORRUPT.value, R.MISSING.value) for r in alive)
        if one_good and ck.status in (S.COMMITTED.value, S.CORRUPT.value) and not condemned(ck):
            ck.status, ck.status_reason, ck.verified_at = S.VERIFIED, None, utcnow()
        elif none_left and ck.status in (S.COMMITTED.value, S.VERIFIED.value):
            why = "; ".join(f"{r.tier}: {r.status} ({r.detail or 'no detail'})" for r in alive)
            ck.status, ck.status_reason = S.CORRUPT, f"no copy verifies: {why or 'no copy left'}"[:2000]
        return str(ck.status)


def condemn(cat: Catalog, checkpoint_id: int, reason: str) -> bool:
    """Mark a checkpoint corrupt for its content: every byte matched, yet it cannot be loaded."""
    with cat.session() as s:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            return False
        lineage.lock_run(s, ck.run_id)
        won = changed(
            s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.id == checkpoint_id,
                    Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]),
                )
                .values(status=S.CORRUPT.value, status_reason=(CONTENT_REASON + reason)[:2000])
            )
        )
    return won == 1


def _without_copy(tier: str, uri: str, run: str | None) -> Select[Any]:
    has_copy = select(Replica.checkpoint_id).where(
        Replica.tier == tier, Replica.uri == uri, Replica.status == R.VERIFIED.value
    )
    q = select(Checkpoint).where(
        Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value]), Checkpoint.id.not_in(has_copy)
    )
    if run is not None:
        q = q.join(Run, Run.id == Checkpoint.run_id).where(Run.name == run)
    return q


def without_copy(cat: Catalog, tier: str, uri: str, run: str | None = None) -> list[Checkpoint]:
    """Restorable checkpoints with no verified copy on the tier rooted at ``uri`` yet, oldest first."""
    with cat.session() as s:
        return list(s.scalars(_without_copy(tier, uri, run).order_by(Checkpoint.id)))


def sent_by_their_hosts(cat: Catalog, tier: str, uri: str, run: str | None = None) -> set[int]:
    """Of ``without_copy``: the checkpoints whose every usable copy is on other hosts' disks (node-local
    tiers this machine cannot read): their hosts send them (``share_push``), nothing here can."""
    ids = _without_copy(tier, uri, run).with_only_columns(Checkpoint.id)
    rows = copy_rows(cat, ids, statuses=USABLE_VALUES)
    return {
        ck for ck, rs in rows.items() if rs and all(disks.elsewhere(r.tier, r.tier_id, r.uri) for r in rs)
    }


def reuse_sources(cat: Catalog, ck: Checkpoint, tier: str, uri: str, limit: int = 3) -> list[tuple[str, str]]:
    """Verified copies of the run's other checkpoints on one tier, as (key, manifest digest), to copy
    unchanged files from: the parent's first (it shares the most), then the newest, at most ``limit``."""
    parent_first = case((Checkpoint.id == ck.parent_id, 0), else_=1)
    with cat.session() as s:
        rows = s.execute(
            select(Replica.key, Checkpoint.step, Checkpoint.manifest_digest, Run.name)
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(
                Checkpoint.run_id == ck.run_id,
                Checkpoint.id != ck.id,
                Checkpoint.status != S.DELETED.value,
                Checkpoint.manifest_digest.is_not(None),
                Replica.tier == tier,
                Replica.uri == uri,
                Replica.status == R.VERIFIED.value,
            )
            .order_by(parent_first, Checkpoint.id.desc())
            .limit(limit)
        ).all()
    return [(locations.key_of(key, run, step), str(digest)) for key, step, digest, run in rows]


def mark_deleted(cat: Catalog, replica_id: int) -> None:
    record(cat, replica_id, R.DELETED, "removed by retention")


def every_copy(cat: Catalog, run: str | None = None) -> list[tuple[Replica, Checkpoint, str]]:
    """Every copy row not let go on purpose, with its checkpoint and run name: what a catalog check compares."""
    with cat.session() as s:
        q = (
            select(Replica, Checkpoint, Run.name)
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Replica.status != R.DELETED.value, Checkpoint.status != S.DELETED.value)
        )
        if run is not None:
            q = q.where(Run.name == run)
        return [(r, c, n) for r, c, n in s.execute(q.order_by(Replica.id)).all()]
