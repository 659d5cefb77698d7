"""The catalog side of one save, shared by the single-process and the sharded checkpointer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rewind.infra.catalog import commits, lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.checkpoint.displaced import Displacer
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
) -> Iterator[tuple[int, Path, Displacer]]:
    """A ``writing`` row for the body to commit, ``aborted`` if it raises.

    Whatever the run held at this step before (a replayed timeline, a step saved again) stays restorable
    until this save commits: ``commits.commit`` supersedes it in the commit's transaction, and its
    directory at ``step-<N>/`` is moved aside only at the rename (the ``Displacer`` yielded, to hand to the
    rename), its rows following it, so no old row ever describes the new bytes; a save that fails puts it
    back and takes nothing away.
    ``writer``: the process saving, which must still be the run's writer (``Fenced`` otherwise).
    """
    if writer is not None:
        commits.require_writer(cat, run_id, writer)
    final = store.step_dir(run_dir, step)
    if (
        not final.exists()
    ):  # rows of older checkpoints that lost this directory must not come to name the new one
        moved_copies.vacate(cat, str(final), "gone before a new save at this step")
    ck_id = commits.begin(
        cat, run_id, step, str(final), parent_id=parent_id, layout=layout, environment=environment
    )
    displace = Displacer(cat, run_id, step, ck_id, writer)
    try:
        yield ck_id, final, displace
    except BaseException as exc:
        displace.put_back()  # first: the row's transition may fail with the catalog that failed the save
        lineage.transition(cat, ck_id, (S.WRITING,), S.ABORTED, f"save failed: {exc}"[:2000])
        raise
