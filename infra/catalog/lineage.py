"""Reading and writing checkpoint lineage.

Every status change is one guarded ``UPDATE ... WHERE status IN (...)``: when
two writers race on a checkpoint, the database lets exactly one of them win and
the loser learns it from the row count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime

from sqlalchemy import Connection, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from rewind.infra.catalog.db import Catalog, changed
from rewind.infra.catalog.models import (
    Checkpoint,
    CheckpointFile,
    CheckpointStatus,
    Replica,
    ReplicaStatus,
    Run,
    utcnow,
)
from rewind.infra.errors import ConfigError, NotFoundError

S = CheckpointStatus


RUN_NAME_BYTES = 200  # a directory name and an S3 key part: counted in UTF-8 bytes, not characters


def check_run_name(name: str) -> None:
    """A run name is a directory on every tier: refuse one that cannot be, once, where runs are created."""
    why = None
    if not name or len(name.encode()) > RUN_NAME_BYTES:
        why = f"must be 1-{RUN_NAME_BYTES} bytes in UTF-8 (it is {len(name.encode())})"
    elif any(c in name for c in "/\\") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        why = "must not hold '/', '\\' or control characters"
    elif name.startswith("."):
        why = "must not start with '.'"
    if why is not None:
        raise ConfigError(f"run name {name[:60]!r} {why}")


def ensure_run(
    cat: Catalog, name: str, *, config_hash: str | None = None, code_version: str | None = None
) -> int:
    check_run_name(name)
    with cat.session() as s:
        run_id = s.scalar(select(Run.id).where(Run.name == name))
        if run_id is not None:
            return run_id
    try:
        with cat.session() as s:
            run = Run(name=name, config_hash=config_hash, code_version=code_version)
            s.add(run)
            s.flush()
            return run.id
    except IntegrityError:  # created concurrently by another process
        return get_run(cat, name).id


def lock_run(s: Session | Connection, run_id: int) -> None:
    """Serialise what changes which checkpoints of a run are restorable: restores, roll-backs,
    verdicts and retention's deletes all take this row lock first (SQLite locks the whole file)."""
    if isinstance(s, Session):
        s.flush()  # what the session added is written before the lock, as an ORM statement would
    conn = s.connection() if isinstance(s, Session) else s
    conn.execute(select(Run.id).where(Run.id == run_id).with_for_update())


def get_run(cat: Catalog, name: str) -> Run:
    with cat.session() as s:
        run = s.scalar(select(Run).where(Run.name == name))
    if run is None:
        raise NotFoundError(f"no run named {name!r} in catalog {cat.safe_url}")
    return run


def list_runs(cat: Catalog) -> list[dict]:
    with cat.session() as s:
        rows = s.execute(
            select(
                Run.name,
                Run.created_at,
                func.count(Checkpoint.id).filter(Checkpoint.status == S.VERIFIED.value),
                func.max(Checkpoint.step).filter(
                    Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value])
                ),
            )
            .outerjoin(Checkpoint, Checkpoint.run_id == Run.id)
            .group_by(Run.id)
            .order_by(Run.created_at)
        ).all()
    return [
        {"run": n, "created_at": c.isoformat(), "verified_checkpoints": v, "latest_step": latest}
        for n, c, v, latest in rows
    ]


def transition(
    cat: Catalog, checkpoint_id: int, allowed_from: Iterable[S], to: S, reason: str | None = None
) -> bool:
    """Move a checkpoint to ``to`` if, and only if, it is in one of ``allowed_from`` now."""
    values: dict = {"status": to.value, "status_reason": reason}
    if to is S.VERIFIED:
        values["verified_at"] = utcnow()
    with cat.session() as s:
        won = changed(
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id == checkpoint_id, Checkpoint.status.in_([a.value for a in allowed_from]))
                .values(**values)
            )
        )
    return won == 1


def restorable(cat: Catalog, run_id: int) -> list[Checkpoint]:
    """Committed or verified checkpoints of a run, newest step first."""
    with cat.session() as s:
        return list(
            s.scalars(
                select(Checkpoint)
                .where(
                    Checkpoint.run_id == run_id, Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value])
                )
                .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
            )
        )


def newest_restorable(cat: Catalog, run_id: int) -> Checkpoint | None:
    """The run's newest committed or verified checkpoint (one row, however long the run)."""
    with cat.session() as s:
        return s.scalars(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value]))
            .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
            .limit(1)
        ).first()


def checkpoints_at(cat: Catalog, run_id: int, step: int, statuses: Iterable[S]) -> list[Checkpoint]:
    with cat.session() as s:
        return list(
            s.scalars(
                select(Checkpoint).where(
                    Checkpoint.run_id == run_id,
                    Checkpoint.step == step,
                    Checkpoint.status.in_([st.value for st in statuses]),
                )
            )
        )


def writing(cat: Catalog, run_id: int) -> list[Checkpoint]:
    with cat.session() as s:
        return list(
            s.scalars(
                select(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.status == S.WRITING.value)
            )
        )


def checkpoints(cat: Catalog, run_name: str, step: int | None = None) -> Sequence[Checkpoint]:
    """Every checkpoint of a run (or those at one step), oldest first."""
    run = get_run(cat, run_name)
    with cat.session() as s:
        q = select(Checkpoint).where(Checkpoint.run_id == run.id)
        if step is not None:
            q = q.where(Checkpoint.step == step)
        return list(s.scalars(q.order_by(Checkpoint.step, Checkpoint.id)))


def listing(cat: Catalog, run_name: str, limit: int | None = None) -> tuple[int, list[Checkpoint]]:
    """A run's checkpoints for a listing, oldest first: every one, or the newest ``limit``; and how many
    there are. Two statements whatever the run's length; the columns no listing shows stay unread."""
    run = get_run(cat, run_name)
    with cat.session() as s:
        q = (
            select(Checkpoint)
            .where(Checkpoint.run_id == run.id)
            .options(defer(Checkpoint.layout), defer(Checkpoint.environment))
        )
        if limit is None:
            rows = list(s.scalars(q.order_by(Checkpoint.step, Checkpoint.id)))
            return len(rows), rows
        newest = list(s.scalars(q.order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).limit(limit)))
        total = s.scalar(select(func.count()).select_from(Checkpoint).where(Checkpoint.run_id == run.id))
    return int(total or 0), newest[::-1]


def files_of(cat: Catalog, checkpoint_id: int) -> list[CheckpointFile]:
    with cat.session() as s:
        return list(
            s.scalars(
                select(CheckpointFile)
                .where(CheckpointFile.checkpoint_id == checkpoint_id)
                .order_by(CheckpointFile.path)
            )
        )


def replicas_of(cat: Catalog, checkpoint_id: int) -> list[Replica]:
    with cat.session() as s:
        return list(
            s.scalars(select(Replica).where(Replica.checkpoint_id == checkpoint_id).order_by(Replica.id))
        )


def iso(ts: datetime | None) -> str | None:
    return ts.isoformat() if ts else None


def get_checkpoint(cat: Catalog, checkpoint_id: int) -> Checkpoint:
    return cat.get(Checkpoint, checkpoint_id, "checkpoint")


def supersede_after(cat: Catalog, run_id: int, step: int, reason: str) -> list[int]:
    """Roll a run's head back: restorable checkpoints newer than ``step`` stop being candidates."""
    with cat.session() as s:
        lock_run(s, run_id)
        ids = list(
            s.scalars(
                update(Checkpoint)
                .where(
                    Checkpoint.run_id == run_id,
                    Checkpoint.step > step,
                    # corrupt too: one with a copy left would otherwise undo the roll-back at the next restore
                    Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]),
                )
                .values(status=S.SUPERSEDED.value, status_reason=reason)
                .returning(Checkpoint.id)
            )
        )
    return ids


def get_run_by_id(cat: Catalog, run_id: int) -> Run:
    return cat.get(Run, run_id, "run")


def set_pinned(cat: Catalog, run: str, step: int, pinned: bool) -> int:
    run_id = get_run(cat, run).id
    with cat.session() as s:
        n = changed(
            s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.run_id == run_id,
                    Checkpoint.step == step,  # the step's live checkpoint, never a save in flight beside it
                    Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value]),
                )
                .values(pinned=pinned)
            )
        )
    if n == 0:
        raise NotFoundError(f"run {run!r} has no live checkpoint at step {step}")
    return n


def replica_bytes(cat: Catalog, run: str | None = None) -> list[tuple[str, int]]:
    """(tier, bytes) of every copy that is not deleted."""
    with cat.session() as s:
        q = select(Replica.tier, Replica.bytes).where(Replica.status != ReplicaStatus.DELETED.value)
        if run is not None:
            q = (
                q.join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
                .join(Run, Run.id == Checkpoint.run_id)
                .where(Run.name == run)
            )
        return [(t, b or 0) for t, b in s.execute(q).all()]
