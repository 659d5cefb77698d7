"""Where copies lie: a copy's key below its tier's root, and whether another checkpoint's copy lies there too.

A key is where a shared or off-site copy lies; a local copy lies at its directory (``uri``). A dead row may
still name a directory or key that a newer copy has taken over, and a copy may be sent where a dead one is
being reclaimed: retention and replication ask here before they delete or write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import Select, or_, select

from rewind.infra.catalog import disks
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica, Run
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R

if TYPE_CHECKING:  # SQLAlchemy 2.1's form (2.0's is ``Select[tuple[...]]``): for the checker alone
    Keys = Select[str | None, int, str]  # copies' keys, steps and run names (``_others``)


def key_of(key: str | None, run: str, step: int) -> str:
    return key if key is not None else f"{run}/step-{step}"  # rows from before keys were recorded


def effective_key(rep: Replica, run: str, step: int) -> str:
    """Where a shared or off-site copy lies below its tier root."""
    return key_of(rep.key, run, step)


def listed_at(cat: Catalog, replica_id: int) -> tuple[str, str | None] | None:
    """Where the copy's row says it lies now (its uri and key); None once it is let go (``mark_deleted``)."""
    with cat.session() as s:
        row = s.execute(
            select(Replica.uri, Replica.key).where(
                Replica.id == replica_id, Replica.status != R.DELETED.value
            )
        ).first()
    return None if row is None else (row[0], row[1])


def _others(tier: str, uri: str, checkpoint_id: int) -> Keys:
    """Other checkpoints' copies not let go on this tier (``uri``): their keys, steps and run names."""
    return (
        select(Replica.key, Checkpoint.step, Run.name)
        .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
        .join(Run, Run.id == Checkpoint.run_id)
        .where(
            Replica.tier == tier,
            Replica.uri == uri,
            Replica.checkpoint_id != checkpoint_id,
            Replica.status != R.DELETED.value,
        )
    )


def _at_key(q: Keys, key: str) -> Keys:
    """Of ``_others``, those that may lie at ``key`` (the same key, or none recorded: the step's)."""
    return q.where(or_(Replica.key == key, Replica.key.is_(None)))


def location_in_use(cat: Catalog, replica_id: int) -> bool:
    """Is where this copy lies also where a copy of another, still wanted checkpoint lies?

    A dead row may still name a directory or key that a newer save of the same step
    has taken over; deleting "its" bytes would delete the new checkpoint. A local copy's
    directory is shared only with copies on the same disk (another host's disk may hold a
    live copy at the same path: that one does not keep this one's bytes).
    """
    wanted = [S.WRITING.value, S.COMMITTED.value, S.VERIFIED.value, S.CORRUPT.value]
    with cat.session() as s:
        me = s.execute(
            select(Replica, Checkpoint.step, Run.name)
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Replica.id == replica_id)
        ).first()
        if me is None:
            return False
        rep, step, run = me
        mine = key_of(rep.key, run, step)
        q = _others(rep.tier, rep.uri, rep.checkpoint_id).where(Checkpoint.status.in_(wanted))
        if rep.tier not in disks.DIRECTORY_TIERS:  # a tier root holds every copy: only the same key can clash
            q = _at_key(q, mine)
        elif rep.tier_id is not None:  # node-local paths repeat across hosts: only this disk's (or unknown)
            q = q.where(or_(Replica.tier_id == rep.tier_id, Replica.tier_id.is_(None)))
        others = s.execute(q).all()
    if rep.tier in disks.DIRECTORY_TIERS:
        return bool(others)
    return any(key_of(k, r, st) == mine for k, st, r in others)


def key_taken(cat: Catalog, checkpoint_id: int, tier: str, uri: str, key: str) -> bool:
    """Does another checkpoint's copy, not deleted yet, lie at ``key`` on this tier (wanted or not)?

    A replication must not write there: a dead copy's bytes are reclaimed before its row is marked deleted
    (``retention._delete_one``), and a reclaim that listed the key would delete files a new copy put
    there (even ones it found already in place and kept) after that copy was registered verified."""
    with cat.session() as s:
        rows = s.execute(_at_key(_others(tier, uri, checkpoint_id), key)).all()
    return any(key_of(k, r, st) == key for k, st, r in rows)
