"""Phase 6, restore: the newest good checkpoint (or a chosen one), from the nearest good copy, made the run's head."""

from __future__ import annotations

from prefect import task

from rewind.infra.phases import restore as phase
from rewind.tasks import progress
from rewind.tasks.common import RETRY, catalog, notifier


@task(name="restore-checkpoint", timeout_seconds=3600, **RETRY)
def restore_checkpoint(
    run: str,
    step: int | None = None,
    roll_back: bool = False,
    reason: str = "",
    before_step: int | None = None,
    proof: str = phase.Proof.BYTES.value,
    lost_hosts: list[str] | None = None,
) -> phase.RestorePoint:
    """Make a verified local copy of the restore point (fetched from a replica if need be), every byte checked.

    ``roll_back`` also retires newer checkpoints so the next launch resumes from the
    chosen one. A chosen step that is corrupt fails at once (not retried); one that
    could not be checked right now (an I/O error) is retried. ``proof="manifest"`` (a recovery):
    the manifest and sizes only, the relaunched job hashing every byte as it loads.
    """
    with progress.shown():
        point = phase.restore_point(
            catalog(),
            run=run,
            notify=notifier(),
            step=step,
            before_step=before_step,
            roll_back=roll_back,
            reason=reason,
            proof=phase.Proof(proof),
            lost_hosts=lost_hosts or (),
        )
    return point
