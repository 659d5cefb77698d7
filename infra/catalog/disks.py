"""Which disk a local copy lies on, as the catalog records it and as this machine sees it.

Node-local disks share paths, so a local copy row keeps its disk's id (``infra/format/local_tier.py``), and
a machine judges only the copies on disks it sees: the rest are ``elsewhere`` (docs/design.md, 2.2).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, select

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Replica, ReplicaStatus
from rewind.infra.format import local_tier

LOCAL = "local"
MEMORY = "memory"  # a node's memory tier (infra/memory): directories on tmpfs, marked like a local disk
DIRECTORY_TIERS = (LOCAL, MEMORY)  # tiers whose copies are directories on one host's own storage
VOLATILE_TIERS = (MEMORY,)  # gone with the host's power: never the copy that keeps a checkpoint restorable
RING_KEY = "ring:"  # a memory copy's key: ``ring:<host>``, one host's share held in another's memory


def ring_source(tier: str, key: str | None) -> str | None:
    """The host whose share a memory copy holds when it is a peer ring's copy (``infra/checkpoint/ring``)."""
    return key[len(RING_KEY) :] if tier == MEMORY and key and key.startswith(RING_KEY) else None


def place(tier: str, uri: str) -> tuple[str | None, str | None]:
    """What to record of where a copy lies: a local copy's disk (tier id, and the host that marked it);
    nothing for the others, which every machine reaches the same way."""
    if tier not in DIRECTORY_TIERS:
        return None, None
    found = local_tier.of_copy(uri)
    return (found.id, found.host) if found is not None else (None, None)


def elsewhere(tier: str, tier_id: str | None, uri: str) -> bool:
    """A local copy on a disk this machine does not see (another host's, where the same path is another
    disk or none): not missing, and not judged here. Only a machine that sees that disk (its host, or any
    on a shared checkpoint root) may find it missing or damaged."""
    if tier not in DIRECTORY_TIERS or tier_id is None:
        return False
    seen = local_tier.of_copy(uri)
    return seen is None or seen.id != tier_id


def same_copy(row: Replica, tier: str, uri: str) -> bool:
    """Is ``row`` the copy at ``uri`` on ``tier`` as this machine sees it (on a local tier: on this disk)?"""
    if row.tier != tier or row.uri != uri:
        return False
    return tier not in DIRECTORY_TIERS or row.tier_id is None or row.tier_id == place(tier, uri)[0]


def this_disk(uri: str) -> Any:
    """Rows of copies on the disk that holds ``uri`` here (or of unknown disk, from before 0012)."""
    seen = local_tier.of_copy(uri)
    return or_(Replica.tier_id.is_(None), Replica.tier_id == (seen.id if seen is not None else ""))


def hosts_holding(cat: Catalog, checkpoint_id: int) -> list[str]:
    """The hosts whose own disks hold a sound copy of the checkpoint (written and hashed, or verified since),
    as the catalog recorded them: where a relaunch reads it without the network; then those whose memory
    holds another host's share of it (the peer ring: a lost host's files are there). Only disks this
    machine does not see count (node-local ones): a root it sees is shared, or its own, and names no host."""
    with cat.session() as s:
        rows = s.execute(
            select(Replica.tier, Replica.host, Replica.tier_id, Replica.uri, Replica.key)
            .where(
                Replica.checkpoint_id == checkpoint_id,
                Replica.tier.in_(DIRECTORY_TIERS),
                Replica.host.is_not(None),
                Replica.status.in_([ReplicaStatus.VERIFIED.value, ReplicaStatus.PENDING.value]),
            )
            .order_by(Replica.id)
        ).all()
    disks = [str(r.host) for r in rows if r.tier == LOCAL and elsewhere(LOCAL, r.tier_id, r.uri)]
    ring = [
        str(r.host)
        for r in rows
        if ring_source(r.tier, r.key) is not None and elsewhere(MEMORY, r.tier_id, r.uri)
    ]
    return list(dict.fromkeys(disks + ring))
