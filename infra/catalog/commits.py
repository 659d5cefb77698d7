"""A save's row from begin to commit: in flight (``writing``) beside whatever the run holds at its step, the
writer fence, and the commit that supersedes the step's old checkpoint in its own transaction."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Connection, Table, and_, case, exists, func, insert, select, update

from rewind.infra.catalog.db import Catalog, changed
from rewind.infra.catalog.lineage import lock_run
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
from rewind.infra.errors import Fenced, RewindError
from rewind.infra.format import local_tier
from rewind.infra.format.manifest import Manifest

S = CheckpointStatus
_CHECKPOINTS = cast(Table, Checkpoint.__table__)  # Core inserts: a save's rows cost the job's CPU
_FILES = cast(Table, CheckpointFile.__table__)
_REPLICAS = cast(Table, Replica.__table__)


def begin(
    cat: Catalog, run_id: int, step: int, path: str, *, parent_id: int | None, layout: dict, environment: dict
) -> int:
    """Record a save in flight. A checkpoint the run already holds at this step stays as it is until this
    one commits (``commit`` supersedes it then): a save that fails must not take it away."""
    row = {"run_id": run_id, "step": step, "path": path, "parent_id": parent_id, "status": S.WRITING.value,
           "layout": layout, "environment": environment}  # fmt: skip
    with cat.session() as s:
        return int(
            s.connection().execute(insert(_CHECKPOINTS).returning(_CHECKPOINTS.c.id), row).scalar_one()
        )


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
        if not s.connection().scalar(select(_fence(writer, run_id))):
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
        c = s.connection()  # Core statements: a save's commit is on the job's time (no ORM objects here)
        _supersede_at_step(c, checkpoint_id)
        guard = [Checkpoint.id == checkpoint_id, Checkpoint.status == S.WRITING.value]
        if writer is not None:
            guard.append(_fence(writer))
        won = changed(
            c.execute(
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
            raise _not_committed(c, checkpoint_id, writer)
        _record_files(c, checkpoint_id, manifest, uri, also_on)


def _record_files(
    c: Connection,
    checkpoint_id: int,
    manifest: Manifest,
    uri: str,
    also_on: Sequence[tuple[str, local_tier.LocalTier]],
) -> None:
    """The committed checkpoint's files, and its local copy (``uri``) with the copies ``also_on``."""
    files = [
        {"checkpoint_id": checkpoint_id, "path": f.path, "size": f.size, "xxh3": f.xxh3, "crc32c": f.crc32c}
        for f in manifest.files
    ]
    if files:
        c.execute(insert(_FILES), files)
    disk = local_tier.of_copy(uri)
    copies = []
    for where, on in [(uri, disk), *also_on]:
        share = manifest.files_on(on.id if on is not None else None)
        copies.append(
            {
                "checkpoint_id": checkpoint_id,
                "tier": "local",
                "uri": where,
                "tier_id": on.id if on is not None else None,
                "host": on.host if on is not None else None,
                "status": ReplicaStatus.PENDING.value,
                "bytes": sum(f.size for f in share),
            }
        )
    c.execute(insert(_REPLICAS), copies)


def _supersede_at_step(s: Connection, checkpoint_id: int) -> None:
    """The run's other checkpoints at this checkpoint's step superseded (one still writing: aborted), under
    the run's lock, before it commits in the same transaction (one live checkpoint a step); rolled back with
    it if it does not."""
    new = s.execute(select(Checkpoint.run_id, Checkpoint.step).where(Checkpoint.id == checkpoint_id)).first()
    if new is None:
        return
    lock_run(s, new.run_id)
    others = (Checkpoint.run_id == new.run_id, Checkpoint.step == new.step, Checkpoint.id != checkpoint_id)
    held = [S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]
    there = s.execute(
        select(Checkpoint.status, Checkpoint.pinned).where(
            *others, Checkpoint.status.in_([S.WRITING.value, *held])
        )
    ).all()  # mostly none: a new step, and nothing to change
    if any(r.status in held and r.pinned for r in there):
        # a pin on the step (set before, or while this save was in flight) moves to the checkpoint it keeps
        s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(pinned=True))
        s.execute(update(Checkpoint).where(*others, Checkpoint.status.in_(held)).values(pinned=False))
    why = f"superseded by a new save at step {new.step}"
    if any(r.status == S.WRITING.value for r in there):
        s.execute(
            update(Checkpoint)
            .where(*others, Checkpoint.status == S.WRITING.value)
            .values(status=S.ABORTED.value, status_reason=why)
        )
    if not any(r.status in held for r in there):
        return
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


def _not_committed(s: Connection, checkpoint_id: int, writer: str | None) -> RewindError:
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
