"""The relaunch's first step completes its incident: relaunch seconds, RTO, topology rebuild time, what the
job loaded and where its bytes came from, and how the loss came back."""

from __future__ import annotations

import logging
from typing import Any

from rewind.infra.catalog import incidents, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.launch.observe import Observation
from rewind.infra.phases.notify import Notifier


def first_step_after_restore(
    cat: Catalog,
    *,
    incident_id: int,
    observed: Observation,
    launched: float,
    died_at: float | None,
    notify: Notifier,
) -> None:
    """The relaunch's first step completes the incident: relaunch seconds, RTO, and what the job loaded
    (a job that had to fall back from the restore point chosen corrects the incident's record)."""
    fields: dict[str, Any] = {"rebuild_s": observed.at - launched}
    ready = observed.detail.get("group_ready_at")
    if died_at is not None:
        fields["rto_s"] = observed.at - died_at
    restored = observed.detail.get("restored") or {}
    details: dict[str, Any] = {
        "first_step_after_restore_at": observed.at,
        "resumed_at_step": observed.detail.get("from_step"),
        "restored_by_job": restored or None,  # what the job loaded, and the bytes it read to load it
        # where those bytes came from: the hosts' own disks (local), other hosts' ranks (peer), a tier
        "restore_read_from": restored.get("read_from"),
        # topology rebuild time: from the launch to every rank's process group passing its smoke test
        "group_ready_s": ready - launched if ready is not None else None,
    }
    inc = incidents.get_incident(cat, incident_id)
    chosen = inc.restored_checkpoint_id
    loaded = restored.get("checkpoint_id") or chosen
    if loaded is not None:  # how the loss came back: the restore point's, then the first step's
        before = (lineage.get_checkpoint(cat, int(loaded)).metrics or {}).get("loss")
        details["loss_change"] = {"restore_point": before, "first_step": observed.detail.get("loss")}
    if restored.get("checkpoint_id") is not None and restored["checkpoint_id"] != chosen:
        # the restore point failed as the job read it, and the job fell back: the incident says what ran
        refused = lineage.get_checkpoint(cat, chosen).step if chosen is not None else None
        notify.log(
            logging.WARNING,
            "the job loaded step %s (checkpoint %s), not the restore point chosen, step %s (checkpoint %s): "
            "that one failed the job's check of every byte it read",
            restored.get("step"), restored["checkpoint_id"], refused, chosen,
        )  # fmt: skip
        fields["restored_checkpoint_id"] = restored["checkpoint_id"]
        last = (inc.details or {}).get("last_step")
        fields["replayed_steps"] = (last if last is not None else restored["step"]) - int(restored["step"])
        details["restore_point_refused"] = chosen
    incidents.update_incident(cat, incident_id, details=details, **fields)
