"""The copies one directory tier holds (a memory tier, by its mark's id), as its keeper weighs them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import select

from rewind.infra.catalog import disks
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica, Run
from rewind.infra.catalog.models import ReplicaStatus as R

GONE = (R.DELETED.value, R.CORRUPT.value)  # a copy let go, or refused and removed: it holds no bytes


@dataclass(frozen=True, slots=True)
class Held:
    replica_id: int
    checkpoint_id: int
    run: str
    step: int
    uri: str
    nbytes: int
    ring: bool = False  # a peer ring's copy: another host's share (infra/checkpoint/ring), not the keeper's
    tier_id: str = ""


def _query(cat: Catalog, *where: Any, order: tuple[Any, ...]) -> list[Held]:
    with cat.session() as s:
        rows = s.execute(
            select(
                Replica.id, Replica.checkpoint_id, Run.name, Checkpoint.step, Replica.uri, Replica.bytes,
                Replica.tier, Replica.key, Replica.tier_id,
            )
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Replica.status.not_in(GONE), *where)
            .order_by(*order)
        ).all()  # fmt: skip
    return [_held(r) for r in rows]


def _held(r: Any) -> Held:
    ring = disks.ring_source(str(r[6]), r[7]) is not None
    return Held(r[0], r[1], str(r[2]), int(r[3]), str(r[4]), int(r[5] or 0), ring, str(r[8] or ""))


def held_on(cat: Catalog, tier: str, tier_id: str) -> list[Held]:
    """The live copies on the tier whose mark is ``tier_id``, oldest step first within each run."""
    return _query(
        cat, Replica.tier == tier, Replica.tier_id == tier_id, order=(Run.name, Checkpoint.step, Replica.id)
    )


def ring_held_by(cat: Catalog, host: str, run: str | None) -> list[Held]:
    """The run's (every run's: None) live peer-ring copies in ``host``'s memory, whatever its tier's mark
    (newest made first)."""
    where = (Replica.tier == disks.MEMORY, Replica.host == host, *((Run.name == run,) if run else ()))
    return _query(cat, *where, Replica.key.like(f"{disks.RING_KEY}%"), order=(Replica.id.desc(),))
