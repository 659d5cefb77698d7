"""The copies one directory tier holds (a memory tier, by its mark's id), as its keeper weighs them."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select

from rewind.infra.catalog import disks
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint, Replica, Run
from rewind.infra.catalog.models import ReplicaStatus as R


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


def held_on(cat: Catalog, tier: str, tier_id: str) -> list[Held]:
    """The live copies on the tier whose mark is ``tier_id``, oldest step first within each run."""
    with cat.session() as s:
        rows = s.execute(
            select(
                Replica.id,
                Replica.checkpoint_id,
                Run.name,
                Checkpoint.step,
                Replica.uri,
                Replica.bytes,
                Replica.key,
                Replica.tier_id,
            )
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(Replica.tier == tier, Replica.tier_id == tier_id, Replica.status != R.DELETED.value)
            .order_by(Run.name, Checkpoint.step, Replica.id)
        ).all()
    return [
        Held(
            r[0],
            r[1],
            str(r[2]),
            int(r[3]),
            str(r[4]),
            int(r[5] or 0),
            disks.ring_source(tier, r[6]) is not None,
        )
        for r in rows
    ]


def ring_held_by(cat: Catalog, host: str, run: str) -> list[Held]:
    """The run's live peer-ring copies in ``host``'s memory, whatever its tier's mark (newest made first)."""
    with cat.session() as s:
        rows = s.execute(
            select(
                Replica.id,
                Replica.checkpoint_id,
                Run.name,
                Checkpoint.step,
                Replica.uri,
                Replica.bytes,
                Replica.tier_id,
            )
            .join(Checkpoint, Checkpoint.id == Replica.checkpoint_id)
            .join(Run, Run.id == Checkpoint.run_id)
            .where(
                Replica.tier == disks.MEMORY,
                Replica.host == host,
                Run.name == run,
                Replica.key.like(f"{disks.RING_KEY}%"),
                Replica.status != R.DELETED.value,
            )
            .order_by(Replica.id.desc())
        ).all()
    return [
        Held(r[0], r[1], str(r[2]), int(r[3]), str(r[4]), int(r[5] or 0), True, str(r[6] or "")) for r in rows
    ]
