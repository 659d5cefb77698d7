"""What the supervisor handed a launch (world size and layout, learning-rate scale, batch, data window to
skip, the restore point), read from the catalog by the job's session; the defaults when the job was started by hand."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rewind.infra.catalog import jobs
from rewind.infra.catalog.db import Catalog
from rewind.infra.health.layout import ENV as LAYOUT_ENV
from rewind.infra.health.layout import Layout
from rewind.infra.restore.plan import RestoreTarget
from rewind.infra.training.comeback import TOLERANCE, Comeback
from rewind.infra.training.progress import LAUNCH_ENV


@dataclass(frozen=True, slots=True)
class Handoff:
    """What the supervisor handed this launch; the defaults when the job was started by hand."""

    launch_id: int | None = None
    world_size: int = 1
    lr_scale: float = 1.0
    global_batch: int | None = None
    skip: tuple[int | None, int] | None = None  # [from, to) of a data window to step over (from: None when
    # the supervisor could not read the restore point's position; the job is there)
    spike_factor: float | None = None  # the spec's loss-spike threshold, when the job sets none itself
    decision: str | None = None
    restore: RestoreTarget | None = None  # the restore point the recovery chose: loaded, not searched for
    comeback: Comeback | None = None  # the failed launch's losses past the restore point, to be held to
    layout: Layout | None = None  # the TP x PP x DP to build (the spec's first, then the planner's)

    @classmethod
    def load(cls, cat: Catalog | None) -> Handoff:
        raw = os.environ.get(LAUNCH_ENV)
        if not raw or cat is None:
            return cls(world_size=int(os.environ.get("WORLD_SIZE", "1")))
        launch = jobs.get_launch(cat, int(raw))
        h = dict(launch.handoff or {})
        skip = h.get("skip")
        return cls(
            launch_id=launch.id,
            world_size=int(h.get("world_size", os.environ.get("WORLD_SIZE", "1"))),
            lr_scale=float(h.get("lr_scale", 1.0)),
            global_batch=h.get("global_batch"),
            skip=(None if skip[0] is None else int(skip[0]), int(skip[1])) if skip else None,
            spike_factor=h.get("spike_factor"),
            decision=h.get("decision"),
            restore=RestoreTarget.from_dict(h.get("restore")),
            comeback=_comeback(h.get("comeback"), Layout.from_dict(h.get("layout"))),
            layout=Layout.from_dict(h.get("layout")),
        )


def handed_layout() -> Layout | None:
    """The TP x PP x DP this launch was handed (``REWIND_LAYOUT``), for a job to build its device mesh from
    before it builds its model; None when the job was started by hand (it uses its own settings)."""
    raw = os.environ.get(LAYOUT_ENV, "").strip()
    return Layout.parse(raw) if raw else None


def _comeback(raw: Any, handed: Layout | None) -> Comeback | None:
    """The failed launch's losses to hold the comeback to; the layout is the same when this launch has the
    world size that one had, and the same TP x PP x DP where both are known."""
    if not isinstance(raw, dict):
        return None
    before = {int(k): float(v) for k, v in dict(raw.get("before") or {}).items()}
    world = int(os.environ.get("WORLD_SIZE", "1"))
    was = Layout.from_dict(raw.get("layout")) if isinstance(raw.get("layout"), dict) else None
    same = raw.get("world_size") in (None, world) and (was is None or handed is None or was == handed)
    return Comeback(before, float(raw.get("tolerance", TOLERANCE)), same_layout=same) if before else None
