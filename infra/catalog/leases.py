"""Restore leases, and the one statement retention deletes with.

A restore holds a lease on the checkpoint it is trying for as long as it uses it.
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

from sqlalchemy import and_, case, delete, exists, func, select, update
from sqlalchemy.orm import aliased

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, RestoreLease, ServingVersion, utcnow
from infra.catalog.models import CheckpointStatus as S
from infra.catalog.serving import KEEPS_CHECKPOINT
from infra.errors import NotFoundError

DEFAULT_TTL_S = 6 * 3600.0
RESTORABLE = (S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value)


def holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


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
            holder=who or holder(),
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
    with cat.session() as s:
        return (
            s.scalar(
                select(func.count())
                .select_from(RestoreLease)
                .where(RestoreLease.checkpoint_id == checkpoint_id, RestoreLease.expires_at > utcnow())
            )
            or 0
        ) > 0


def delete_guarded(cat: Catalog, checkpoint_id: int, *, keep_last: int, reason: str) -> bool:
    """Mark a checkpoint deleted for retention if, and only if, nothing needs it now."""
    newer = aliased(Checkpoint)
    with cat.session() as s:
        ck = s.get(Checkpoint, checkpoint_id)
        if ck is None:
            return False
        lineage.lock_run(s, ck.run_id)
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
        won = s.execute(
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
        ).rowcount
    return won == 1
