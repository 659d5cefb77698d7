"""Phase 3, replicate: copy committed checkpoints to another tier, verified before they count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from infra.catalog import lineage
from infra.tiers import filesystem
from tasks.common import RETRY, catalog, emit


@task(name="pending-replication", **RETRY)
def pending_replication(tier: str, run: str | None = None) -> list[int]:
    return [ck.id for ck in lineage.without_replica(catalog(), tier, run)]


@task(name="replicate-checkpoint", timeout_seconds=6 * 3600, **RETRY)
def replicate_checkpoint(checkpoint_id: int, target: str) -> dict[str, Any]:
    """Copy one checkpoint to a shared path; only a copy whose bytes match the manifest is registered."""
    cat = catalog()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    dest, copied = filesystem.replicate(Path(ck.path), filesystem.target_root(target), run)
    lineage.record_replica(cat, ck.id, "shared", str(dest), ck.total_bytes or 0)
    result = {
        "run": run,
        "step": ck.step,
        "checkpoint_id": ck.id,
        "tier": "shared",
        "uri": str(dest),
        "bytes_copied": copied,
    }
    emit("rewind.checkpoint.replicated", run, result, step=ck.step, checkpoint_id=ck.id)
    return result
