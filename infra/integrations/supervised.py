"""What a training library's callback tells the supervisor (``protect-training``): the same for every library.

A callback holds one ``ProgressWriter`` where the job was launched by a supervisor (the handoff names the
launch) and none otherwise; each function here is a no-op without one, so a callback calls them
unconditionally.
"""

from __future__ import annotations

from typing import NoReturn

from rewind.infra.catalog import models
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import is_transient
from rewind.infra.health.signals import LossWatch
from rewind.infra.training.progress import ProgressWriter
from rewind.infra.training.session import Handoff, TrainingAnomaly


def start_writer(
    writer: ProgressWriter | None, catalog: Catalog, handoff: Handoff, heartbeat_s: float, busy: str
) -> ProgressWriter | None:
    """``writer`` if started already; else, under a supervisor, a new one started ``busy``; else None."""
    if writer is None and handoff.launch_id is not None:
        writer = ProgressWriter(catalog, handoff.launch_id, 0, interval_s=heartbeat_s)
        writer.start(busy)
    return writer


def restore_failed(writer: ProgressWriter | None, exc: BaseException) -> None:
    """Tell the supervisor the restore failed (a failed restore, not a job that cannot start), and end."""
    if writer is not None:
        why = {"reason": f"{type(exc).__name__}: {exc}"[:1000], "transient": is_transient(exc)}
        writer.note(restore_failed=why)
        writer.finish(models.RankState.FAILED)


def restored(writer: ProgressWriter | None, *, checkpoint_id: int, step: int, bytes_read: int) -> None:
    """Tell the supervisor where training resumes and what was read to get there."""
    if writer is not None:
        writer.note(
            start_step=step, restored={"checkpoint_id": checkpoint_id, "step": step, "bytes_read": bytes_read}
        )


def check_loss(writer: ProgressWriter | None, watch: LossWatch, step: int, loss: float) -> None:
    """Raise ``TrainingAnomaly`` for a NaN/Inf or spiking loss, told to the supervisor first."""
    found = watch.observe(step, loss)
    if found is not None:
        _anomaly(writer, found.kind, step, found.reason)


def _anomaly(writer: ProgressWriter | None, kind: str, step: int, reason: str) -> NoReturn:
    if writer is not None:
        writer.note(anomaly={"kind": kind, "step": step, "reason": reason})
        writer.finish(models.RankState.FAILED)
    raise TrainingAnomaly(reason)
