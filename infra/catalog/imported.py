"""Catalog rows made from a manifest found on storage, not from a save in progress.

Used by the catalog rebuild and by adoption: a checkpoint enters whole (files,
status, times from its manifest, its first copy, its pin) in one transaction,
never half. Lineage that only the set of all manifests can tell (parents, which
timeline is live) is settled afterwards, by :func:`link_parents` and
:func:`retire_abandoned`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select, update

from rewind.infra.catalog import disks, lineage
from rewind.infra.catalog.db import Catalog, chunks
from rewind.infra.catalog.models import LIVE_STATUSES, Checkpoint, CheckpointFile, Replica, aware, utcnow
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import RewindError
from rewind.infra.format.manifest import Manifest

REBUILT = "rebuilt from storage: "


@dataclass(frozen=True, slots=True)
class FirstCopy:
    tier: str
    uri: str
    key: str | None
    status: R


def manifest_time(m: Manifest) -> datetime:
    """When the writer says it wrote the checkpoint (UTC); the epoch when it does not say."""
    try:
        return aware(datetime.fromisoformat(m.created_at))
    except ValueError:
        return datetime.fromtimestamp(0, UTC)


def by_digest(cat: Catalog, run_id: int, digest: str) -> Checkpoint | None:
    """The checkpoint of this run whose manifest has this digest, whatever its status."""
    with cat.session() as s:
        return s.scalar(
            select(Checkpoint)
            .where(Checkpoint.run_id == run_id, Checkpoint.manifest_digest == digest)
            .order_by(Checkpoint.id.desc())
        )


def insert(
    cat: Catalog,
    run_id: int,
    m: Manifest,
    *,
    digest: str,
    path: str,
    copy: FirstCopy,
    pinned: bool = False,
) -> int:
    """One checkpoint from its manifest, with its files and first copy, in one transaction.

    Live, unless a save written later holds its step (then it comes in superseded); a
    live row written earlier at the step is superseded instead. A step with a save in
    progress is refused: its writer is about to commit it.
    """
    written, verified = manifest_time(m), copy.status is R.VERIFIED
    tier_id, host = disks.place(copy.tier, copy.uri)
    with cat.session() as s:
        lineage.lock_run(s, run_id)
        at_step = s.scalars(
            select(Checkpoint).where(
                Checkpoint.run_id == run_id,
                Checkpoint.step == m.step,
                Checkpoint.status.in_([st.value for st in LIVE_STATUSES]),
            )
        ).all()
        if any(c.status == S.WRITING.value for c in at_step):
            raise RewindError(f"step {m.step} is being saved right now: left to its writer")
        live = at_step[0] if at_step else None  # one committed or verified at most (the step's index)
        status, reason = (S.VERIFIED if verified else S.COMMITTED), None
        if live is not None and aware(live.created_at) >= written:
            status, reason = S.SUPERSEDED, f"{REBUILT}a later save holds step {m.step}"
        elif live is not None:
            live.status, live.status_reason = S.SUPERSEDED, f"{REBUILT}a later save holds step {m.step}"
            s.flush()
        ck = Checkpoint(
            run_id=run_id, step=m.step, status=status.value, status_reason=reason, path=path,
            layout=m.layout, total_bytes=m.total_bytes, manifest_digest=digest, environment=m.environment,
            metrics=m.metrics, created_at=written, committed_at=written, pinned=pinned,
            verified_at=utcnow() if verified else None,
        )  # fmt: skip
        s.add(ck)
        s.flush()
        s.add_all(
            CheckpointFile(checkpoint_id=ck.id, path=f.path, size=f.size, xxh3=f.xxh3, crc32c=f.crc32c)
            for f in m.files
        )
        s.add(
            Replica(
                checkpoint_id=ck.id, tier=copy.tier, uri=copy.uri, key=copy.key, tier_id=tier_id, host=host,
                status=copy.status.value,
                bytes=m.total_bytes, checked_at=utcnow(), verified_at=utcnow() if verified else None,
            )
        )  # fmt: skip
        return ck.id


def link_parents(cat: Catalog, run_id: int, parents: dict[int, tuple[int | None, str | None]]) -> int:
    """Set each listed checkpoint's parent. A manifest naming its parent's digest is linked to exactly
    that checkpoint (and re-linked when an earlier pass guessed); an older one to the checkpoint at the
    parent step written last before it. Returns how many were linked."""
    linked = 0
    with cat.session() as s:
        rows = list(s.scalars(select(Checkpoint).where(Checkpoint.run_id == run_id)))
        by_digest = {r.manifest_digest: r for r in rows if r.manifest_digest}
        by_id = {r.id: r for r in rows}
        for ck_id, (step, digest) in parents.items():
            ck = by_id.get(ck_id)
            if ck is None:
                continue
            if digest is not None:
                parent = by_digest.get(digest)
            elif ck.parent_id is None and step is not None:
                before = [r for r in rows if r.step == step and aware(r.created_at) <= aware(ck.created_at)]
                parent = max(before, key=lambda r: aware(r.created_at), default=None)
            else:
                parent = None
            if parent is not None and ck.parent_id != parent.id:
                ck.parent_id = parent.id
                linked += 1
    return linked


def retire_abandoned(
    cat: Catalog, run_id: int, ids: Collection[int], exempt: Collection[int] = ()
) -> list[int]:
    """A checkpoint written before a save at a lower step belongs to a timeline the run rolled back
    from: among ``ids``, those are superseded, as the roll-back did to them in the original catalog.

    ``exempt`` (adopted checkpoints, whose times are when they were adopted, not written) neither
    retire nor are retired. Writer clocks decide "before".
    """
    with cat.session() as s:
        lineage.lock_run(s, run_id)
        rows = list(
            s.scalars(
                select(Checkpoint).where(
                    Checkpoint.run_id == run_id,
                    Checkpoint.status.in_([st.value for st in (*LIVE_STATUSES, S.SUPERSEDED)]),
                )
            )
        )
        skip, wanted = set(exempt), set(ids)  # exempt filtered here: NOT IN would bind a parameter per id
        rows = [a for a in rows if a.id not in skip]
        below = _latest_below(rows)
        gone = [
            a.id
            for a in rows
            if a.id in wanted
            and a.status in (S.COMMITTED.value, S.VERIFIED.value)
            and (later := below[a.step]) is not None
            and later > aware(a.created_at)
        ]
        for batch in chunks(gone):  # one transaction; at most MAX_IDS parameters a statement
            s.execute(
                update(Checkpoint)
                .where(Checkpoint.id.in_(batch))
                .values(status=S.SUPERSEDED.value, status_reason=f"{REBUILT}the run rolled back past it")
            )
    return gone


def _latest_below(rows: list[Checkpoint]) -> dict[int, datetime | None]:
    """Per step, the latest write time among checkpoints at lower steps (None: there are none): one pass
    in step order instead of comparing every pair, which a run of 100,000 checkpoints cannot afford."""
    out: dict[int, datetime | None] = {}
    latest: datetime | None = None
    steps = sorted({r.step for r in rows})
    at_step: dict[int, datetime] = {}
    for r in rows:
        t = aware(r.created_at)
        at_step[r.step] = max(t, at_step.get(r.step, t))
    for step in steps:
        out[step] = latest
        latest = at_step[step] if latest is None else max(latest, at_step[step])
    return out


def pin(cat: Catalog, checkpoint_id: int) -> None:
    """Pin one checkpoint whatever its status: an adopted directory is never Rewind's to delete."""
    with cat.session() as s:
        s.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(pinned=True))
