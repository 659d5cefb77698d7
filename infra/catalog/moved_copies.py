"""Copy rows that follow a local copy's directory: moved aside (``moved``), gone (``vacate``), or, told by
another host's rank, moved or gone on that host's disk (``followed``). Node-local paths repeat across
hosts, so the rows touched are one disk's: this disk's (and rows from before disks were recorded), or the
named disk's, matched by its id."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Update, select, true, update

from rewind.infra.catalog import disks
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica, utcnow
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.format.local_tier import LocalTier

LOCAL = disks.LOCAL


def moved(cat: Catalog, old_uri: str, new_uri: str, reason: str) -> None:
    """A local directory was moved aside: every copy row that pointed at it follows it there.

    Its status stays what the last check found: moving bytes out of the way proves nothing about them.
    """
    with cat.session() as s:
        s.execute(_moving(old_uri, new_uri, reason, None, None))


def followed(
    cat: Catalog,
    moves: Sequence[tuple[str, str | None, LocalTier]],
    reason: str,
    *,
    staying: str | None = None,
) -> None:
    """Other hosts' disks moved their copies at these paths aside (``(old, new, disk)``; ``new`` None:
    nothing lay there): in one transaction, the rows on each disk (matched by its id: another host's path may
    be this host's too) follow them (``moved``) or are let go (``vacate``); those of the checkpoint whose
    manifest digest is ``staying`` (its copy made there now, by a restore) stay."""
    with cat.session() as s:
        for old, new, disk in moves:
            if new is None:
                s.execute(_vacating(old, "gone before a new copy at this path", disk))
            else:
                s.execute(_moving(old, new, reason, disk, staying))


def _moving(old_uri: str, new_uri: str, reason: str, disk: LocalTier | None, staying: str | None) -> Update:
    kept = select(Checkpoint.id).where(Checkpoint.manifest_digest == staying)
    others = Replica.checkpoint_id.not_in(kept) if staying is not None else true()
    return update(Replica).where(*_rows_at(old_uri, disk), others).values(uri=new_uri, detail=reason)


def vacate(cat: Catalog, uri: str, reason: str) -> None:
    """Nothing lies at this local path any more: copy rows still naming it are let go."""
    with cat.session() as s:
        s.connection().execute(_vacating(uri, reason, None))  # Core: before every save, on the job's time


def _vacating(uri: str, reason: str, disk: LocalTier | None) -> Update:
    gone = {"status": R.DELETED.value, "detail": reason, "checked_at": utcnow()}
    return update(Replica).where(*_rows_at(uri, disk)).values(**gone)


def _rows_at(uri: str, disk: LocalTier | None) -> tuple[Any, ...]:
    """The live rows of local copies at ``uri`` on ``disk`` (``_on_disk``)."""
    return (Replica.tier == LOCAL, Replica.uri == uri, Replica.status != R.DELETED.value, _on_disk(uri, disk))


def _on_disk(uri: str, disk: LocalTier | None) -> Any:
    """Rows of copies on ``disk`` (another host's: its paths may be this host's too), else on the disk that
    holds ``uri`` here."""
    return Replica.tier_id == disk.id if disk is not None else disks.this_disk(uri)
