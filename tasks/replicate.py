"""Phase 3, replicate: copy committed checkpoints to another tier, verified before they count."""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.catalog import lineage
from infra.tiers import catalogued, open_tier
from tasks.common import RETRY, catalog, emit


@task(name="pending-replication", **RETRY)
def pending_replication(target: str, run: str | None = None) -> list[int]:
    """Committed checkpoints without a verified copy on the tier of ``target``."""
    return [ck.id for ck in lineage.without_replica(catalog(), open_tier(target).name, run)]


@task(name="replicate-checkpoint", timeout_seconds=6 * 3600, **RETRY)
def replicate_checkpoint(
    checkpoint_id: int, target: str, part_size_mib: int = 64, concurrency: int = 8
) -> dict[str, Any]:
    """Copy one checkpoint; only a copy the target proves equal to the manifest is registered."""
    cat = catalog()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    options = (
        {"part_size": part_size_mib << 20, "concurrency": concurrency} if target.startswith("s3://") else {}
    )
    tier = open_tier(target, **options)
    tier.check()
    sent = catalogued.replicate_recorded(cat, ck, tier)
    result = {
        "run": run,
        "step": ck.step,
        "checkpoint_id": ck.id,
        "tier": tier.name,
        "uri": target,
        "bytes_sent": sent,
    }
    emit("rewind.checkpoint.replicated", run, result, step=ck.step, checkpoint_id=ck.id)
    return result


@task(name="apply-retention", **RETRY)
def apply_retention(run: str | None, keep_last: int, keep_every: int = 0) -> dict[str, list[int]]:
    """Delete what the policy no longer keeps, on every tier; returns the removed steps per run."""
    from infra import retention

    cat = catalog()
    policy = retention.Policy(keep_last=keep_last, keep_every=keep_every)
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    return {name: retention.execute(cat, retention.plan(cat, name, policy)) for name in runs}
