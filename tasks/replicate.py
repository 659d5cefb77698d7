"""Phase 3, replicate: copy checkpoints to another tier, from a verified source, registered only when proven there."""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger, task

from infra import retention
from infra.catalog import copies, lineage
from infra.replication import replicate
from infra.tiers import open_tier
from tasks import progress
from tasks.common import RETRY, catalog, emit


@task(name="pending-replication", **RETRY)
def pending_replication(target: str, run: str | None = None) -> list[int]:
    """Restorable checkpoints without a verified copy on ``target`` yet."""
    tier = open_tier(target)
    return [ck.id for ck in copies.without_copy(catalog(), tier.name, tier.uri, run)]


@task(name="replicate-checkpoint", timeout_seconds=6 * 3600, **RETRY)
def replicate_checkpoint(
    checkpoint_id: int, target: str, part_size_mib: int = 64, concurrency: int = 8
) -> dict[str, Any]:
    """Copy one checkpoint; only a copy the target proves equal to the catalog's manifest is registered."""
    cat = catalog()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    options = (
        {"part_size": part_size_mib << 20, "concurrency": concurrency} if target.startswith("s3://") else {}
    )
    tier = open_tier(target, **options)
    tier.check()
    started = time.monotonic()
    with progress.shown():
        done = replicate(cat, ck, tier)
    took = time.monotonic() - started
    get_run_logger().info(
        "%s step %d replicated to %s/%s: %d bytes sent, %d reused from earlier copies there, in %.1fs%s",
        run,
        ck.step,
        target,
        done.key,
        done.bytes_sent,
        done.bytes_reused,
        took,
        " (already there, verified)" if done.already_there else "",
    )
    result = {
        "run": run,
        "step": ck.step,
        "checkpoint_id": ck.id,
        "tier": tier.name,
        "uri": target,
        "key": done.key,
        "bytes_sent": done.bytes_sent,
        "bytes_reused": done.bytes_reused,
    }
    emit("rewind.checkpoint.replicated", run, result, step=ck.step, checkpoint_id=ck.id)
    return result


@task(name="apply-retention", **RETRY)
def apply_retention(run: str | None, keep_last: int, keep_every: int = 0) -> dict[str, list[int]]:
    """Delete what the policy no longer keeps, on every tier, each deletion re-checked; removed steps per run."""
    cat = catalog()
    policy = retention.Policy(keep_last=keep_last, keep_every=keep_every)
    runs = [run] if run else [r["run"] for r in lineage.list_runs(cat)]
    with progress.shown():
        removed = {name: retention.execute(cat, retention.plan(cat, name, policy), policy) for name in runs}
    for name, steps in removed.items():
        if steps:
            get_run_logger().info("retention on %s (keep_last %d): removed steps %s", name, keep_last, steps)
    return removed
