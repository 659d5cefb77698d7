"""Restore leases, and the one statement retention deletes with.

A restore holds a lease on the checkpoint it is trying for as long as it uses it.
A process killed while it held one (a job that crashed mid-restore, a memory agent killed mid-copy) never
releases it: a lease whose holder is a process of this host's boot and pid namespace that is gone holds
nothing (``holder_gone``), so what it held does not wait ``DEFAULT_TTL_S`` to be let go (any other holder
waits for the expiry).
Retention's plan is only a read; what makes deletion safe is :func:`delete_guarded`,
which re-checks everything in the same statement that marks the checkpoint deleted,
under the run's row lock (which restores and roll-backs take too): no lease, not
pinned, not serving, still committed or verified, and at least ``keep_last`` newer
verified checkpoints for a verified one, at least one for any other (so the newest
verified checkpoint is never deleted).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, case, delete, exists, func, select, update
from sqlalchemy.orm import aliased

from rewind.infra.catalog import lineage
from rewind.infra.catalog.db import Catalog, changed
from rewind.infra.catalog.models import Checkpoint, Launch, RestoreLease, Run, ServingVersion, aware, utcnow
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.serving import KEEPS_CHECKPOINT
from rewind.infra.errors import NotFoundError, RunBusy
from rewind.infra.format import pids

DEFAULT_TTL_S = 6 * 3600.0
RESTORABLE = (S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value)


def holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def lease_holder() -> str:
    """This process as a restore lease's holder: host, pid, and where its pid means something
    (``pids.space``), so that another process can tell when it is gone."""
    space = pids.space()
    return f"{holder()}:{space}" if space else holder()


def holder_gone(who: str) -> bool:
    """Whether the process a lease's holder names (``lease_holder``, maybe more after a colon) is surely
    gone: a process of this host's boot and pid namespace that no longer runs. Any other holder (another
    host, a container's pids, a name without its pid space) may still be alive."""
    host, pid, space = [*who.split(":"), "", ""][:3]
    return (
        host == socket.gethostname()
        and bool(space)
        and space == pids.space()
        and pid.isdigit()
        and not pids.alive(int(pid))
    )


def take(cat: Catalog, checkpoint_id: int, who: str | None = None, ttl_s: float = DEFAULT_TTL_S) -> int:
    now = utcnow()
    with cat.session() as s:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            raise NotFoundError(f"no checkpoint with id {checkpoint_id}")
        lineage.lock_run(s, ck.run_id)
        s.refresh(ck)  # as it is now, under the lock: retention may have deleted it since the plan
        if ck.status not in RESTORABLE:
            raise NotFoundError(f"checkpoint {ck.run_id}@{ck.step} is {ck.status} now")
        lease = RestoreLease(
            checkpoint_id=checkpoint_id,
            holder=who or lease_holder(),
            taken_at=now,
            expires_at=now + timedelta(seconds=ttl_s),
        )
        s.add(lease)
        s.flush()
        return lease.id


def release(cat: Catalog, lease_id: int) -> None:
    with cat.session() as s:
        s.execute(delete(RestoreLease).where(RestoreLease.id == lease_id))


def leased(cat: Catalog, checkpoint_id: int) -> bool:
    """Whether a restore holds ``checkpoint_id`` now."""
    return checkpoint_id in _held(cat, RestoreLease.checkpoint_id == checkpoint_id)


def leased_in_run(cat: Catalog, run_id: int) -> set[int]:
    """The run's checkpoints a restore holds now: :func:`leased` for a whole run in one statement."""
    run_of = select(Checkpoint.id).where(Checkpoint.run_id == run_id)
    return _held(cat, RestoreLease.checkpoint_id.in_(run_of))


def _held(cat: Catalog, which: Any) -> set[int]:
    """The checkpoints of the unexpired leases ``which`` selects whose holders may be alive."""
    with cat.session() as s:
        rows = s.execute(
            select(RestoreLease.checkpoint_id, RestoreLease.holder).where(
                which, RestoreLease.expires_at > utcnow()
            )
        ).all()
    return {checkpoint_id for checkpoint_id, who in rows if not holder_gone(who)}


def _forget_gone(s: Any, checkpoint_id: int) -> None:
    """The checkpoint's leases whose holders are gone, deleted (in the caller's transaction)."""
    rows = s.execute(
        select(RestoreLease.id, RestoreLease.holder).where(RestoreLease.checkpoint_id == checkpoint_id)
    ).all()
    gone = [lease_id for lease_id, who in rows if holder_gone(who)]
    if gone:
        s.execute(delete(RestoreLease).where(RestoreLease.id.in_(gone)))


def delete_guarded(cat: Catalog, checkpoint_id: int, *, keep_last: int, reason: str) -> bool:
    """Mark a checkpoint deleted for retention if, and only if, nothing needs it now."""
    newer = aliased(Checkpoint)
    with cat.session() as s:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            return False
        lineage.lock_run(s, ck.run_id)
        _forget_gone(s, checkpoint_id)  # a restore killed on this host holds it no more
        newer_verified = (
            select(func.count())
            .select_from(newer)
            .where(newer.run_id == ck.run_id, newer.status == S.VERIFIED.value, newer.step > ck.step)
            .scalar_subquery()
        )
        lease = exists().where(
            and_(RestoreLease.checkpoint_id == checkpoint_id, RestoreLease.expires_at > utcnow())
        )
        serving = exists().where(
            and_(
                ServingVersion.checkpoint_id == checkpoint_id,
                ServingVersion.state.in_([v.value for v in KEEPS_CHECKPOINT]),
            )
        )
        won = changed(
            s.execute(
                update(Checkpoint)
                .where(
                    Checkpoint.id == checkpoint_id,
                    Checkpoint.status.in_([S.COMMITTED.value, S.VERIFIED.value]),
                    Checkpoint.pinned.is_(False),
                    ~lease,
                    ~serving,
                    # A verified checkpoint goes only behind keep_last newer verified ones; any other behind one.
                    newer_verified >= case((Checkpoint.status == S.VERIFIED.value, keep_last), else_=1),
                )
                .values(status=S.DELETED.value, status_reason=reason)
            )
        )
    return won == 1


# -- the one writer of a run ---------------------------------------------------------------

WRITER_TTL_S = 3600.0  # a holder silent this long (no save, no refresh) is presumed gone


def writer_name() -> str:
    """This process as a run's writer: host and pid, and the launch when a supervisor started it."""
    launch = os.environ.get("REWIND_LAUNCH_ID")
    return f"{holder()}:{launch}" if launch else holder()


def _gone(cat_session: Any, writer: str, seen_at: Any) -> bool:
    """Is the process named by ``writer`` surely no longer writing?"""
    host, _, rest = writer.partition(":")
    pid_text, _, launch = rest.partition(":")
    if launch.isdigit():
        row = cat_session.get(Launch, int(launch))
        if row is not None and row.ended_at is not None:
            return True  # its supervisor saw the launch end
    if host == socket.gethostname() and pid_text.isdigit() and not pids.alive(int(pid_text)):
        return True
    return seen_at is None or (utcnow() - aware(seen_at)).total_seconds() > WRITER_TTL_S


def live_writer(cat: Catalog, run: str) -> str | None:
    """The process writing ``run`` now (as ``take_writer`` would find it), or None."""
    with cat.session() as s:
        row = s.scalars(select(Run).where(Run.name == run)).first()
        if row is None or row.writer is None or _gone(s, row.writer, row.writer_seen_at):
            return None
        return str(row.writer)


def take_writer(cat: Catalog, run_id: int, who: str | None = None) -> None:
    """Become the run's one writer, or ``RunBusy`` naming the process that is."""
    me = who or writer_name()
    with cat.session() as s:
        lineage.lock_run(s, run_id)
        run = s.get(Run, run_id)
        if run is None:
            raise NotFoundError(f"no run with id {run_id}")
        if run.writer not in (None, me) and not _gone(s, run.writer, run.writer_seen_at):
            seen = run.writer_seen_at.isoformat(timespec="seconds") if run.writer_seen_at else "never"
            raise RunBusy(
                f"run {run.name!r} is being written by {run.writer} (last seen {seen}): stop it first"
            )
        run.writer, run.writer_seen_at = me, utcnow()


def touch_writer(cat: Catalog, run_id: int, who: str | None = None) -> None:
    """Still here (every committed save says so)."""
    with cat.session() as s:
        s.connection().execute(  # Core: after every save, on the job's time
            update(Run)
            .where(Run.id == run_id, Run.writer == (who or writer_name()))
            .values(writer_seen_at=utcnow())
        )


def release_writer(cat: Catalog, run_id: int, who: str | None = None) -> None:
    with cat.session() as s:
        s.execute(
            update(Run).where(Run.id == run_id, Run.writer == (who or writer_name())).values(writer=None)
        )
