"""Reading and writing checkpoint lineage.

Every status change is one guarded ``UPDATE ... WHERE status IN (...)``: when
two writers race on a checkpoint, the database lets exactly one of them win and
the loser learns it from the row count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import and_, case, exists, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, defer

from rewind.infra.catalog.db import Catalog, changed
from rewind.infra.catalog.models import (
    Checkpoint,
    CheckpointFile,
    CheckpointStatus,
    Launch,
    Replica,
    ReplicaStatus,
    Run,
    utcnow,
)
from rewind.infra.errors import ConfigError, Fenced, NotFoundError, RewindError
from rewind.infra.format import local_tier
from rewind.infra.format.manifest import Manifest

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


def lock_run(s: Session, run_id: int) -> None:
    """Serialise what changes which checkpoints of a run are restorable: restores, roll-backs,
    verdicts and retention's deletes all take this row lock first (SQLite locks the whole file)."""
    s.execute(select(Run.id).where(Run.id == run_id).with_for_update())


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


def begin(
    cat: Catalog, run_id: int, step: int, path: str, *, parent_id: int | None, layout: dict, environment: dict
) -> int:
    """Record a save in flight. A checkpoint the run already holds at this step stays as it is until this
    one commits (``commit`` supersedes it then): a save that fails must not take it away."""
    with cat.session() as s:
        ck = Checkpoint(
            run_id=run_id,
            step=step,
            path=path,
            parent_id=parent_id,
            status=S.WRITING.value,
            layout=layout,
            environment=environment,
        )
        s.add(ck)
        s.flush()
        return ck.id


def _fence(writer: str, run_id: Any = Checkpoint.run_id) -> Any:
    """Still the run's writer, and of a launch its supervisor has not seen end (an isolated host's
    orphaned rank 0 must never commit once the job was relaunched elsewhere). ``run_id``: the run (default:
    the checkpoint row's in the statement)."""
    launch = writer.rsplit(":", 2)[-1] if writer.count(":") >= 2 else ""
    ok: Any = exists().where(Run.id == run_id, Run.writer == writer)
    if launch.isdigit():
        ok = and_(ok, ~exists().where(Launch.id == int(launch), Launch.ended_at.is_not(None)))
    return ok


def require_writer(cat: Catalog, run_id: int, writer: str) -> None:
    """``Fenced`` unless ``writer`` is still the run's writer, of a launch not seen ended: checked when a save
    begins and again before it moves anything aside (a writer fenced off must never touch the live writer's
    checkpoints)."""
    with cat.session() as s:
        if not s.scalar(select(_fence(writer, run_id))):
            raise Fenced(
                f"run {run_id}: {writer} is no longer the run's writer (its launch ended, or another process "
                "took the run over): nothing saved"
            )


def commit(
    cat: Catalog,
    checkpoint_id: int,
    manifest: Manifest,
    *,
    digest: str,
    stall_s: float | None,
    uri: str,
    writer: str | None = None,
    also_on: Sequence[tuple[str, local_tier.LocalTier]] = (),
) -> None:
    """``writing -> committed`` with its manifest digest, files and local copy, in one transaction; with
    ``writer``, only while that process is the run's writer (else ``Fenced``, and nothing is committed).
    What the run held at the step before (a replayed timeline, a step saved again) is superseded in the
    same transaction, never earlier. ``also_on``: the copies (directory, disk) on other hosts' disks of a
    checkpoint spread over them, each holding its disk's share."""
    now = utcnow()
    with cat.session() as s:
        _supersede_at_step(s, checkpoint_id)
        guard = [Checkpoint.id == checkpoint_id, Checkpoint.status == S.WRITING.value]
        if writer is not None:
            guard.append(_fence(writer))
        won = changed(
            s.execute(
                update(Checkpoint)
                .where(*guard)
                .values(
                    status=S.COMMITTED.value,
                    committed_at=now,
                    total_bytes=manifest.total_bytes,
                    manifest_digest=digest,
                    metrics=manifest.metrics,
                    save_stall_s=stall_s,
                )
            )
        )
        if won != 1:
            raise _not_committed(s, checkpoint_id, writer)
        s.add_all(
            CheckpointFile(
                checkpoint_id=checkpoint_id, path=f.path, size=f.size, xxh3=f.xxh3, crc32c=f.crc32c
            )
            for f in manifest.files
        )
        disk = local_tier.of_copy(uri)
        for where, on in [(uri, disk), *also_on]:
            share = manifest.files_on(on.id if on is not None else None)
            s.add(
                Replica(
                    checkpoint_id=checkpoint_id,
                    tier="local",
                    uri=where,
                    tier_id=on.id if on is not None else None,
                    host=on.host if on is not None else None,
                    status=ReplicaStatus.PENDING.value,
                    bytes=sum(f.size for f in share),
                )
            )


def _supersede_at_step(s: Session, checkpoint_id: int) -> None:
    """The run's other checkpoints at this checkpoint's step superseded (one still writing: aborted), under
    the run's lock, before it commits in the same transaction (one live checkpoint a step); rolled back with
    it if it does not."""
    new = s.execute(select(Checkpoint.run_id, Checkpoint.step).where(Checkpoint.id == checkpoint_id)).first()
    if new is None:
        return
    lock_run(s, new.run_id)
    others = (Checkpoint.run_id == new.run_id, Checkpoint.step == new.step, Checkpoint.id != checkpoint_id)
    held = [S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]
    if s.scalar(select(exists().where(*others, Checkpoint.status.in_(held), Checkpoint.pinned.is_(True)))):
        # a pin on the step (set before, or while this save was in flight) moves to the checkpoint it keeps
        s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(pinned=True))
        s.execute(update(Checkpoint).where(*others, Checkpoint.status.in_(held)).values(pinned=False))
    why = f"superseded by a new save at step {new.step}"
    s.execute(
        update(Checkpoint)
        .where(*others, Checkpoint.status == S.WRITING.value)
        .values(status=S.ABORTED.value, status_reason=why)
    )
    s.execute(
        update(Checkpoint)
        .where(*others, Checkpoint.status.in_(held))
        .values(
            status=S.SUPERSEDED.value,
            status_reason=case(
                (
                    Checkpoint.status == S.CORRUPT.value,
                    func.substr(
                        why + " (it was corrupt: " + func.coalesce(Checkpoint.status_reason, "") + ")",
                        1,
                        2000,
                    ),
                ),
                else_=why,
            ),
        )
    )


def _not_committed(s: Session, checkpoint_id: int, writer: str | None) -> RewindError:
    """Why a commit changed nothing: the writer was fenced off (still ``writing``), or it was not writing."""
    if (
        writer is not None
        and s.scalar(select(Checkpoint.status).where(Checkpoint.id == checkpoint_id)) == S.WRITING.value
    ):
        return Fenced(
            f"checkpoint {checkpoint_id} not committed: {writer} is no longer the run's writer "
            "(its launch ended, or another process took the run over)"
        )
    return RewindError(f"checkpoint {checkpoint_id} was no longer 'writing' at commit")


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
