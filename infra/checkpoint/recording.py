"""The catalog side of one save, shared by the single-process and the sharded checkpointer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rewind.infra.catalog import lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.errors import MalformedFile
from rewind.infra.format import files, store
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_matches


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

    Whatever the run held at this step before (a replayed timeline, a step saved again) stays restorable
    until this save commits: ``lineage.commit`` supersedes it in the commit's transaction, and its
    directory at ``step-<N>/`` is moved aside only at the rename (``displacer``), its rows following it, so
    no old row ever describes the new bytes and a save that fails takes nothing away.
    ``writer``: the process saving, which must still be the run's writer (``Fenced`` otherwise).
    """
    if writer is not None:
        lineage.require_writer(cat, run_id, writer)
    final = store.step_dir(run_dir, step)
    if (
        not final.exists()
    ):  # rows of older checkpoints that lost this directory must not come to name the new one
        moved_copies.vacate(cat, str(final), "gone before a new save at this step")
    ck_id = lineage.begin(
        cat, run_id, step, str(final), parent_id=parent_id, layout=layout, environment=environment
    )
    try:
        yield ck_id, final
    except BaseException as exc:
        lineage.transition(cat, ck_id, (S.WRITING,), S.ABORTED, f"save failed: {exc}"[:2000])
        raise


def displacer(cat: Catalog) -> store.Displace:
    """What moves a directory already at a save's ``step-<N>/`` aside just before the new one is renamed in
    (a checkpoint of this step the run held: still committed until the new one commits), its rows following
    it there."""

    def displace(final: Path) -> None:
        moved_copies.moved(
            cat, str(final), str(store.quarantine(final, "superseded")), "superseded by a new save"
        )

    return displace


def held_by_live(cat: Catalog, run_id: int, step: int, directory: Path) -> bool:
    """Whether ``directory`` holds the manifest of a checkpoint the run holds at ``step`` (committed, verified
    or corrupt): a save in flight at the step that died before its rename left that one in place."""
    try:
        with files.open_regular(directory, mf.MANIFEST_NAME) as f:
            raw = mf.read_bounded(f)
    except (OSError, MalformedFile):
        return False
    live = lineage.checkpoints_at(cat, run_id, step, (S.COMMITTED, S.VERIFIED, S.CORRUPT))
    return any(ck.manifest_digest and manifest_matches(raw, ck.manifest_digest) for ck in live)
