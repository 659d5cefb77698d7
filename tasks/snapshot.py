"""Phase 1, snapshot: for training loops that are themselves Prefect flows.

Multi-rank jobs and plain scripts call ``Checkpointer.save`` directly; the
supervising flow notices their commits instead.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from infra.checkpoint.engine import Checkpointer, SaveMode
from tasks.common import emit


@task(name="snapshot", retries=0)
def snapshot(
    checkpointer: Checkpointer, step: int, metrics: dict[str, float] | None = None
) -> dict[str, Any]:
    """Save the training state; returns the stall and, once committed, the checkpoint id and digest."""
    stall = checkpointer.save(step, metrics=metrics)
    result: dict[str, Any] = {"run": checkpointer.run, "step": step, "stall_s": stall}
    saved = checkpointer.last_saved
    if checkpointer.mode is SaveMode.SYNC and saved is not None:
        result |= {
            "checkpoint_id": saved.checkpoint_id,
            "manifest_digest": saved.manifest_digest,
            "bytes": saved.total_bytes,
        }
        emit(
            "rewind.checkpoint.committed",
            checkpointer.run,
            result,
            step=step,
            checkpoint_id=saved.checkpoint_id,
        )
    return result
