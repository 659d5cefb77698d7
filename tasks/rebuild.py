"""Phase 5, rebuild, as a Prefect task (``phases.rebuild``)."""

from __future__ import annotations

from prefect import task

from rewind.infra.phases import rebuild as phase
from rewind.infra.phases.rebuild import Rebuilt
from rewind.tasks.common import RETRY, catalog, notifier


@task(name="rebuild-environment", **RETRY)
def rebuild_environment(
    run: str, incident_id: int, shrink_on_crash: bool = True, checkpoint_id: int | None = None
) -> Rebuilt:
    """The spec and handoff of the relaunch: fewer ranks for a crash that cost devices, else the same; on a
    scheduler, hosts holding the restore point (``checkpoint_id``) on their own disks first."""
    return phase.rebuild_environment(
        catalog(), run=run, incident_id=incident_id, notify=notifier(), shrink_on_crash=shrink_on_crash,
        checkpoint_id=checkpoint_id,
    )  # fmt: skip
