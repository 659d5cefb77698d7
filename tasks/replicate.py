"""Phase 3, replicate: copy checkpoints to another tier, from a verified source, registered only when proven there."""

from __future__ import annotations

from typing import Any

from prefect import task

from rewind.infra import retention
from rewind.infra.phases import replicate as phase
from rewind.infra.tiers import open_tier
from rewind.tasks import progress
from rewind.tasks.common import RETRY, catalog, notifier


@task(name="pending-replication", **RETRY)
def pending_replication(target: str, run: str | None = None) -> list[int]:
    """Restorable checkpoints without a verified copy on ``target`` yet."""
    return phase.pending(catalog(), tier=open_tier(target), run=run)


@task(name="replicate-checkpoint", timeout_seconds=6 * 3600, **RETRY)
def replicate_checkpoint(
    checkpoint_id: int, target: str, part_size_mib: int = 64, concurrency: int = 8
) -> dict[str, Any]:
    """Copy one checkpoint; only a copy the target proves equal to the catalog's manifest is registered."""
    tier = phase.open_target(target, phase.TierOptions(part_size_mib=part_size_mib, concurrency=concurrency))
    with progress.shown():
        made = phase.replicate_checkpoint(
            catalog(), checkpoint_id=checkpoint_id, tier=tier, notify=notifier()
        )
    return made.as_dict()


@task(name="apply-retention", **RETRY)
def apply_retention(run: str | None, keep_last: int, keep_every: int = 0) -> dict[str, list[int]]:
    """Delete what the policy no longer keeps, on every tier, each deletion re-checked; removed steps per run."""
    policy = retention.Policy(keep_last=keep_last, keep_every=keep_every)
    with progress.shown():
        return phase.apply_retention(catalog(), policy=policy, notify=notifier(), run=run)
