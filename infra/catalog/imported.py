"""Catalog rows made from a manifest found on storage, not from a save in progress.

Used by the catalog rebuild and by adoption: a checkpoint enters whole (files,
status, times from its manifest) in one transaction, never half. Lineage that
only the set of all manifests can tell (parents, which timeline is live) is
settled afterwards, by :func:`link_parents` and :func:`retire_abandoned`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import select, update

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import LIVE_STATUSES, Checkpoint, CheckpointFile, utcnow
from infra.catalog.models import CheckpointStatus as S
from infra.format.manifest import Manifest

REBUILT = "rebuilt from storage: "


def aware(t: datetime) -> datetime:
    """SQLite hands timestamps back without a zone; every one Rewind writes is UTC."""
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def manifest_time(m: Manifest) -> datetime:
    """When the writer says it wrote the checkpoint (UTC); the epoch when it does not say."""
    try:
        t = datetime.fromisoformat(m.created_at)
    except ValueError:
        return datetime.fromtimestamp(0, UTC)
    return aware(t)


def by_digest(cat: Catalog, run_id: int, digest: str) -> Checkpoint | None:
    """The checkpoint of this run whose manifest has this digest, whatever its status."""
    with cat.session() as s:
        return s.scalar(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.manifest_digest == digest)
            .order_by(Checkpoint.id.desc())
        )


def insert(cat: Catalog, run_id: int, m: Manifest, *, digest: str, path: str, verified: bool) -> int:
    """One checkpoint from its manifest. Live unless a newer save already holds its step (then superseded)."""
    written = manifest_time(m)
    with cat.session() as s:
        lineage.lock_run(s, run_id)
        live = s.scalar(
            select(Checkpoint).where(
                Checkpoint.run_id == run_id,
                Checkpoint.step == m.step,
                Checkpoint.status.in_([st.value for st in LIVE_STATUSES]),
            )
        )
        status, reason = (S.VERIFIED if verified else S.COMMITTED), None
        if live is not None and aware(live.created_at) >= written:
            status, reason = S.SUPERSEDED, f"{REBUILT}a later save holds step {m.step}"
        elif live is not None:
            live.status, live.status_reason = S.SUPERSEDED.value, f"{REBUILT}a later save holds step {m.step}"
            s.flush()
        ck = Checkpoint(
            run_id=run_id,
            step=m.step,
            status=status.value,
            status_reason=reason,
            path=path,
            layout=m.layout,
            total_bytes=m.total_bytes,
            manifest_digest=digest,
            environment=m.environment,
            metrics=m.metrics,
            created_at=written,
            committed_at=written,
            verified_at=utcnow() if verified else None,
        )
        s.add(ck)
        s.flush()
        s.add_all(
            CheckpointFile(checkpoint_id=ck.id, path=f.path, size=f.size, xxh3=f.xxh3, crc32c=f.crc32c)
            for f in m.files
        )
        return ck.id


def link_parents(cat: Catalog, run_id: int, parents: dict[int, tuple[int | None, str | None]]) -> int:
    """Set each listed checkpoint's parent: by the parent's manifest digest when its manifest names one,
    else the checkpoint at the parent step written last before it. Returns how many were linked."""
    linked = 0
    with cat.session() as s:
        rows = list(s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id)))
        for ck in rows:
            if ck.id not in parents or ck.parent_id is not None:
                continue
            step, digest = parents[ck.id]
            match = [r for r in rows if digest is not None and r.manifest_digest == digest]
            if not match and step is not None:
                match = sorted(
                    (r for r in rows if r.step == step and aware(r.created_at) <= aware(ck.created_at)),
                    key=lambda r: aware(r.created_at),
                )[-1:]
            if match:
                ck.parent_id = match[-1].id
                linked += 1
    return linked


def retire_abandoned(cat: Catalog, run_id: int, ids: Sequence[int]) -> list[int]:
    """A checkpoint written before a save at a lower step belongs to a timeline the run rolled back
    from: among ``ids``, those are superseded, as the roll-back did to them in the original catalog."""
    with cat.session() as s:
        lineage.lock_run(s, run_id)
        live = list(
            s.scalars(
                select(Checkpoint).where(
                    Checkpoint.run_id == run_id,
                    Checkpoint.status.in_([st.value for st in (*LIVE_STATUSES, S.SUPERSEDED)]),
                )
            )
        )
        gone = [
            a.id
            for a in live
            if a.id in ids
            and a.status != S.SUPERSEDED.value
            and any(b.step < a.step and aware(b.created_at) > aware(a.created_at) for b in live)
        ]
        if gone:
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id.in_(gone))
                .values(status=S.SUPERSEDED.value, status_reason=f"{REBUILT}the run rolled back past it")
            )
    return gone
