"""Tier operations that also keep the catalog's replica records true.

Shared by the CLI and the Prefect tasks, so there is one way to replicate,
verify and restore a copy.
"""

from __future__ import annotations

import logging
from pathlib import Path

from infra.catalog import lineage
from infra.catalog.db import Catalog
from infra.catalog.models import Checkpoint, CheckpointStatus, Replica
from infra.checkpoint import store
from infra.checkpoint.verify import Finding
from infra.tiers import open_tier, replication
from infra.tiers.base import Tier

log = logging.getLogger("rewind.tiers")
TIER_ORDER = {"local": 0, "shared": 1, "offsite": 2}  # nearest first


def replicate_recorded(cat: Catalog, ck: Checkpoint, tier: Tier) -> int:
    """Copy one committed checkpoint to ``tier`` and record the verified replica; returns bytes sent."""
    run = lineage.get_run_by_id(cat, ck.run_id).name
    sent = replication.replicate(Path(ck.path), tier, run)
    lineage.record_replica(cat, ck.id, tier.name, tier.uri, ck.total_bytes or 0)
    log.info("replicated %s step %d to %s (%d bytes sent)", run, ck.step, tier.uri, sent)
    return sent


def verify_replica(cat: Catalog, ck: Checkpoint, replica: Replica, *, deep: bool) -> list[Finding]:
    """Check one replica; a failing one is marked corrupt, a passing one verified (nothing else changes)."""
    run = lineage.get_run_by_id(cat, ck.run_id).name
    findings = replication.verify_remote(open_tier(replica.uri), run, ck.step, ck.manifest_digest, deep=deep)
    status = "corrupt" if any(f.fatal for f in findings) else "verified"
    if status == "corrupt" or deep:
        lineage.record_replica(cat, ck.id, replica.tier, replica.uri, replica.bytes or 0, status=status)
    return findings


def remote_replicas(cat: Catalog, checkpoint_id: int) -> list[Replica]:
    """Verified copies other than the local one, nearest tier first."""
    reps = [
        r for r in lineage.replicas_of(cat, checkpoint_id) if r.tier != "local" and r.status == "verified"
    ]
    return sorted(reps, key=lambda r: TIER_ORDER.get(r.tier, 9))


def restore_to_local(cat: Catalog, ck: Checkpoint, replica: Replica, root: Path) -> Path:
    """Materialise a replica into the local tier (verified byte for byte) and point the catalog at it."""
    run = lineage.get_run_by_id(cat, ck.run_id).name
    final = store.step_dir(root / run, ck.step)
    # While this runs, retention must leave the checkpoint alone (see retention.plan).
    lineage.record_replica(cat, ck.id, "local", str(final), ck.total_bytes or 0, status="restoring")
    try:
        if final.exists():
            store.quarantine(final, "replaced-from-replica")
        path, manifest = replication.materialize(open_tier(replica.uri), run, ck.step, root / run)
    except BaseException:
        lineage.record_replica(cat, ck.id, "local", str(final), ck.total_bytes or 0, status="corrupt")
        raise
    lineage.set_path(cat, ck.id, str(path))
    lineage.record_replica(cat, ck.id, "local", str(path), manifest.total_bytes)
    if ck.status == CheckpointStatus.CORRUPT:  # the local copy was bad, the checkpoint itself is fine
        lineage.transition(
            cat,
            ck.id,
            (CheckpointStatus.CORRUPT,),
            CheckpointStatus.VERIFIED,
            f"restored from {replica.tier}",
        )
    log.info("materialised %s step %d from %s into %s", run, ck.step, replica.uri, path)
    return path
