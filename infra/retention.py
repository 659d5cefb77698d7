"""Retention that follows lineage: which checkpoints a policy keeps, and removing the rest safely.

Never removed: the newest restorable checkpoint, anything pinned, anything being
restored, anything a serving version points at, anything the policy keeps. Removal takes the catalog reference away first (a guarded status
change, so a concurrent restore that already chose the checkpoint keeps its
row), then the bytes: on every tier the manifest goes first, so a half-deleted
copy is never mistaken for a checkpoint.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from infra.catalog import lineage, serving
from infra.catalog.db import Catalog
from infra.catalog.models import CheckpointStatus
from infra.checkpoint import manifest as mf
from infra.errors import ConfigError
from infra.tiers import open_tier, replication

log = logging.getLogger("rewind.gc")
S = CheckpointStatus


@dataclass(frozen=True, kw_only=True)
class Policy:
    keep_last: int = 3
    """The newest N restorable checkpoints are kept (at least 1: the one a restart would use)."""
    keep_every: int = 0
    """Checkpoints whose step is a multiple of K are kept as well (0: none)."""
    byte_budget: int | None = None
    """If set, the oldest checkpoints kept only by ``keep_every`` go until the local bytes fit."""

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1: the newest checkpoint is what a restart needs")
        if self.keep_every < 0 or (self.byte_budget is not None and self.byte_budget < 0):
            raise ConfigError("keep_every and byte_budget cannot be negative")


@dataclass
class Removal:
    checkpoint_id: int
    step: int
    bytes: int
    copies: list[tuple[str, str]]  # (tier, uri) including local


@dataclass
class GcPlan:
    run: str
    keep: list[int]
    remove: list[Removal] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(r.bytes * len(r.copies) for r in self.remove)


def plan(cat: Catalog, run: str, policy: Policy) -> GcPlan:
    """A pure read of the catalog: what stays, what goes, and how many bytes that frees."""
    live = lineage.restorable(cat, lineage.get_run(cat, run).id)  # newest first
    keep = {c.id for c in live[: policy.keep_last]}
    keep |= {c.id for c in live if c.pinned}
    keep |= {c.id for c in live} & serving.protected_checkpoints(cat)
    keep |= {c.id for c in live if any(r.status == "restoring" for r in lineage.replicas_of(cat, c.id))}
    by_every = [c for c in live if policy.keep_every and c.step % policy.keep_every == 0 and c.id not in keep]
    if policy.byte_budget is not None:
        total = sum((c.total_bytes or 0) for c in live if c.id in keep)
        for c in by_every:  # newest first: the oldest are the ones left out
            if total + (c.total_bytes or 0) > policy.byte_budget:
                continue
            total += c.total_bytes or 0
            keep.add(c.id)
    else:
        keep |= {c.id for c in by_every}
    out = GcPlan(run, sorted(c.step for c in live if c.id in keep))
    for c in live:
        if c.id in keep:
            continue
        copies = [(r.tier, r.uri) for r in lineage.replicas_of(cat, c.id) if r.status != "deleted"]
        out.remove.append(Removal(c.id, c.step, c.total_bytes or 0, copies))
    return out


def execute(cat: Catalog, gc: GcPlan) -> list[int]:
    """Remove what the plan says; returns the steps actually removed."""
    removed = []
    for r in gc.remove:
        if not lineage.transition(
            cat, r.checkpoint_id, (S.COMMITTED, S.VERIFIED), S.DELETED, "retention policy"
        ):
            continue  # changed under us (pinned, restored, already gone): leave it
        lineage.mark_replicas_deleted(cat, r.checkpoint_id)
        for tier, uri in r.copies:
            try:
                _delete_copy(tier, uri, gc.run, r.step)
            except Exception as exc:  # the catalog no longer points here; the bytes are orphans, not a risk
                log.warning(
                    "could not delete %s copy of %s step %d at %s: %s", tier, gc.run, r.step, uri, exc
                )
        removed.append(r.step)
    return removed


def _delete_copy(tier: str, uri: str, run: str, step: int) -> None:
    if tier == "local":
        path = Path(uri)
        (path / mf.MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
        return
    t = open_tier(uri)
    base = replication.checkpoint_key(run, step)
    t.delete(f"{base}/{mf.MANIFEST_NAME}")
    for obj in list(t.list(f"{base}/")):
        t.delete(obj.key)


def usage(cat: Catalog, run: str | None, price_per_gb_month: float) -> list[dict[str, object]]:
    """Bytes held per tier and what they cost a month."""
    totals: dict[str, int] = {}
    for row in lineage.replica_bytes(cat, run):
        totals[row[0]] = totals.get(row[0], 0) + int(row[1] or 0)
    return [
        {
            "tier": t,
            "bytes": b,
            "gb": round(b / 1e9, 3),
            "usd_per_month": round(b / 1e9 * price_per_gb_month, 2),
        }
        for t, b in sorted(totals.items())
    ]
