"""What a training session does once its state is restored: the loss watch starts from the losses the run
had at its checkpoints, and a data window the supervisor wants skipped is stepped over by the loader."""

from __future__ import annotations

import logging
from typing import Any

from rewind.infra.catalog import lineage, models
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import ConfigError, RewindError
from rewind.infra.health.signals import LossWatch

log = logging.getLogger("rewind.session")
# checkpoints whose recorded loss the watch starts from after a restore (the run's lineage up to it)
SEEDS = (models.CheckpointStatus.COMMITTED, models.CheckpointStatus.VERIFIED)


def position_of(loader: Any) -> int | None:
    """The loader's global position (samples of the global order consumed); None when it has none."""
    return getattr(loader, "position", None) if loader is not None else None


def seed_watch(watch: LossWatch, catalog: Catalog, run: str, start_step: int) -> None:
    """After a restore to ``start_step``, ``watch`` starts from the losses the run had at its checkpoints up to
    it (the catalog's record of each save): a spike on the way back is seen at once."""
    if start_step <= 0:
        return
    try:
        rows = lineage.checkpoints(catalog, run)
    except RewindError as exc:  # the watch fills again as it goes; nothing else depends on this
        log.warning("loss history before the restore not read: %s", exc)
        return
    at = {
        c.step: float(c.metrics["loss"])
        for c in sorted(rows, key=lambda c: c.id)
        if c.step <= start_step
        and c.status in SEEDS
        and isinstance((c.metrics or {}).get("loss"), int | float)
    }
    watch.seed([at[step] for step in sorted(at)])


def skip_window(loader: Any, skip: tuple[int | None, int] | None) -> None:
    """Samples ``skip`` (a bad data window the supervisor chose) stepped over by ``loader``; a loader with
    no global position to skip in is refused in one line."""
    if skip is None:
        return
    if loader is None:
        log.warning(
            "the supervisor asked to skip samples %s..%d, but this job gave the session no loader", *skip
        )
        return
    at, skip_to = position_of(loader), getattr(loader, "skip_to", None)
    if at is None or skip_to is None:
        raise ConfigError(
            f"the supervisor asked to skip samples {skip[0]}..{skip[1]} (a bad data window), but "
            f"{type(loader).__name__} has no global position to skip in: use ResumableLoader"
        )
    if at < skip[1]:
        log.warning("skipping samples %d..%d (a bad data window)", at, skip[1])
        skip_to(skip[1])
