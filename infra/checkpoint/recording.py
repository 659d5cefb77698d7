"""The catalog side of one save, shared by the single-process and the sharded checkpointer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rewind.infra.catalog import lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.format import store


@contextlib.contextmanager
def recorded_save(
    cat: Catalog,
    run_id: int,
    run_dir: Path,
    step: int,
    *,
    parent_id: int | None,
    layout: dict,
    environment: dict,
    writer: str | None = None,
) -> Iterator[tuple[int, Path]]:
    """A ``writing`` row for the body to commit, ``aborted`` if it raises.

    Whatever the run held at this step before (a replayed timeline) is superseded
    first, and a directory already at ``step-<N>/`` is moved aside, with every row
    that pointed at it following it, so no old row ever describes the new bytes.
    ``writer``: the process saving, which must still be the run's writer before anything is superseded
    (``Fenced`` otherwise: an orphaned writer must never take the live one's checkpoint at the step away).
    """
    if writer is not None:
        lineage.require_writer(cat, run_id, writer)
    final = store.step_dir(run_dir, step)
    for old in lineage.checkpoints_at(cat, run_id, step, (S.WRITING, S.COMMITTED, S.VERIFIED, S.CORRUPT)):
        lineage.transition(
            cat,
            old.id,
            (S(old.status),),
            S.ABORTED if old.status == S.WRITING else S.SUPERSEDED,
            f"superseded by a new save at step {step}"
            + (f" (it was corrupt: {old.status_reason})" if old.status == S.CORRUPT else ""),
        )
    if final.exists():
        moved_copies.moved(
            cat, str(final), str(store.quarantine(final, "superseded")), "superseded by a new save"
        )
    else:  # rows of older checkpoints that lost this directory must not come to name the new one
        moved_copies.vacate(cat, str(final), "gone before a new save at this step")
    ck_id = lineage.begin(
        cat, run_id, step, str(final), parent_id=parent_id, layout=layout, environment=environment
    )
    try:
        yield ck_id, final
    except BaseException as exc:
        lineage.transition(cat, ck_id, (S.WRITING,), S.ABORTED, f"save failed: {exc}"[:2000])
        raise
