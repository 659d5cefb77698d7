"""Phase 1, snapshot: for training loops that call it themselves (a loop that is a Prefect flow).

Multi-rank jobs and plain scripts call ``Checkpointer.save`` directly; the supervising
phase notices their commits instead and announces them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rewind.infra.checkpoint.engine import Checkpointer, SaveMode
from rewind.infra.phases.notify import Notifier, run_event


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The stall a save cost and, once committed (synchronous mode), what it committed."""

    run: str
    step: int
    stall_s: float
    checkpoint_id: int | None = None
    manifest_digest: str | None = None
    bytes: int | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run": self.run, "step": self.step, "stall_s": self.stall_s}
        if self.checkpoint_id is not None:
            out |= {
                "checkpoint_id": self.checkpoint_id,
                "manifest_digest": self.manifest_digest,
                "bytes": self.bytes,
            }
        return out


def snapshot(
    checkpointer: Checkpointer, *, step: int, notify: Notifier, metrics: Mapping[str, float] | None = None
) -> Snapshot:
    """Save the training state; a committed save is announced (``rewind.checkpoint.committed``)."""
    stall = checkpointer.save(step, metrics=metrics)
    saved = checkpointer.last_saved
    if checkpointer.mode is not SaveMode.SYNC or saved is None:
        return Snapshot(checkpointer.run, step, stall)
    done = Snapshot(
        checkpointer.run, step, stall, saved.checkpoint_id, saved.manifest_digest, saved.total_bytes
    )
    event = run_event(
        "rewind.checkpoint.committed", done.run, done.as_dict(), step=step, checkpoint_id=saved.checkpoint_id
    )
    notify.event(event)
    return done
