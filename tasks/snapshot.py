"""Phase 1, snapshot, as a Prefect task (``phases.snapshot``): for training loops that are Prefect flows."""

from __future__ import annotations

from prefect import task

from rewind.infra.checkpoint.engine import Checkpointer
from rewind.infra.phases import snapshot as phase
from rewind.infra.phases.snapshot import Snapshot
from rewind.tasks.common import NO_CACHE, notifier


@task(name="snapshot", retries=0, cache_policy=NO_CACHE)
def snapshot(checkpointer: Checkpointer, step: int, metrics: dict[str, float] | None = None) -> Snapshot:
    """Save the training state; returns the stall and, once committed, the checkpoint id and digest."""
    return phase.snapshot(checkpointer, step=step, notify=notifier(), metrics=metrics)
