"""Rewind's Chaos Toolkit probes: what a drill checks about the job and its checkpoints, before and
after hurting them (``{"type": "python", "module": "rewind.infra.drills.probes", "func": ...}``)."""

from __future__ import annotations

import time
from typing import Any

from rewind.infra.catalog import incidents, jobs, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.drills import slo
from rewind.infra.drills.context import newest, run_of, state_dir
from rewind.infra.errors import NotFoundError
from rewind.infra.restore.scrub import scrub

POLL_S = 0.2


def newest_checkpoint_verifies(configuration: dict[str, Any] | None = None) -> bool:
    """The newest restorable checkpoint proves itself, every byte, on every copy this machine can reach (true
    when there is none yet; copies on other hosts' own disks are theirs to judge, and at least one copy must
    be reachable here: the local one, or the shared or off-site one its hosts sent)."""
    ck = newest(run_of(configuration))
    return ck is None or scrub(Catalog(), ck, deep=True).ok


def offsite_copies_verified(configuration: dict[str, Any] | None = None) -> bool:
    """The run has an off-site copy, and every off-site copy the catalog registered for it is verified."""
    run, cat = run_of(configuration), Catalog()
    try:
        cks = lineage.checkpoints(cat, run)
    except NotFoundError:
        return False
    offsite = [r for ck in cks for r in lineage.replicas_of(cat, ck.id) if r.tier == "offsite"]
    return bool(offsite) and all(r.status == "verified" for r in offsite)


def run_finished(configuration: dict[str, Any] | None = None) -> bool:
    """The run's newest launch ended with exit code 0 (the job ran to its end)."""
    try:
        ls = jobs.launches(Catalog(), run_of(configuration))
    except NotFoundError:
        return False
    return bool(ls) and ls[-1].exit_code == 0


def fault_fired(configuration: dict[str, Any] | None = None) -> bool:
    return (state_dir(configuration) / "fault-fired").exists()


def run_progressing(within_s: float = 30.0, configuration: dict[str, Any] | None = None) -> bool:
    """The run's newest launch finished cleanly, or one of its ranks advanced within ``within_s``
    (true before the run exists: nothing to be stuck)."""
    run, cat = run_of(configuration), Catalog()
    try:
        ls = jobs.launches(cat, run)
    except NotFoundError:
        return True
    if not ls:
        return True
    if ls[-1].exit_code is not None:
        return ls[-1].exit_code == 0
    deadline = time.monotonic() + within_s

    def steps() -> int:
        return max((p.step or 0 for p in jobs.progress(cat, ls[-1].id)), default=0)

    first = steps()
    while time.monotonic() < deadline:
        time.sleep(POLL_S)
        if steps() > first or jobs.get_launch(cat, ls[-1].id).exit_code == 0:
            return True
    return False


def incident_resolved_within_slo(
    kind: str, slo_file: str | None = None, configuration: dict[str, Any] | None = None
) -> bool:
    """The run's newest incident is resolved, within the SLO's RTO for ``kind`` (true with no incident)."""
    run = run_of(configuration)
    try:
        found = incidents.incidents_of(Catalog(), run)
    except NotFoundError:
        return True
    if not found:
        return True
    inc = found[-1]
    budget = slo.load(slo_file or (configuration or {}).get("slo_file")).for_kind(kind)
    return inc.resolved_at is not None and inc.rto_s is not None and inc.rto_s <= budget.rto_s
