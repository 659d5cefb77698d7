"""The directory of a step saved again: moved aside only at the new save's rename, and put back if it fails.

A run's checkpoint at a step stays its checkpoint until a new save of that step commits (design.md §4).
At the new save's rename its directory, ``step-<N>/``, is moved into ``.quarantine/`` with its copy rows
following it (still committed there: a restore reads it where it lies); should the save then fail, its
own copy is moved out and the old one put back, rows following. A writer fenced off since it began never
moves a directory that holds a newer save's checkpoint. What could not be put back (a writer killed, its
catalog failing) the next start puts back (``put_back_all``), and retention never reclaims it meanwhile
(``superseded_live``): found by the manifest it holds, whatever the rows name.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from rewind.infra.catalog import commits, lineage, moved_copies
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import CheckpointStatus as S
from rewind.infra.errors import Fenced, MalformedFile
from rewind.infra.format import files, store
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import manifest_matches

log = logging.getLogger("rewind.checkpoint")
HELD = (S.COMMITTED, S.VERIFIED, S.CORRUPT)  # a checkpoint whose copy must not be taken for a dead save's


class Displacer:
    """What a save of ``step`` (its row ``ck_id``, by ``writer``) calls at its rename with the directory in
    the way; ``put_back`` after the save failed."""

    def __init__(self, cat: Catalog, run_id: int, step: int, ck_id: int, writer: str | None) -> None:
        self._cat, self._run_id, self._step, self._ck_id, self._writer = cat, run_id, step, ck_id, writer
        self.moved: tuple[Path, Path] | None = None  # (the step's directory, where it lies now)

    def __call__(self, final: Path) -> None:
        if self._writer is not None:
            commits.require_writer(self._cat, self._run_id, self._writer)
        newer = [c for c in _holding(self._cat, self._run_id, self._step, final) if c.id > self._ck_id]
        if newer:
            raise Fenced(
                f"{final} holds step {self._step} as a later save committed it: this save is not the run's"
            )
        moved = store.quarantine(final, "superseded")
        self.moved = (final, moved)  # from here on, put back should anything fail
        try:
            moved_copies.moved(self._cat, str(final), str(moved), "superseded by a new save")
        except BaseException:
            with contextlib.suppress(OSError):
                os.rename(moved, final)  # the rows still name it there
                self.moved = None
            raise

    def put_back(self) -> None:
        """The save failed: what lies at the step moved out (never a live checkpoint's), the displaced one moved
        back, rows following; nothing while this writer is fenced off (the live writer's save may lie there).
        Best effort: what cannot be done now is done by the next start (``put_back_all``)."""
        if self.moved is None:
            return
        final, moved = self.moved
        try:
            if self._writer is not None:
                commits.require_writer(self._cat, self._run_id, self._writer)
            _back(self._cat, self._run_id, self._step, final, moved)
        except Exception as exc:  # the catalog or the disk that failed the save, or fenced off
            log.warning(
                "step %d: the checkpoint moved aside to %s stays there for now: %s", self._step, moved, exc
            )


def put_back_all(cat: Catalog, run_id: int, run_dir: Path) -> None:
    """At a writer's start: each live checkpoint's directory that a save of its step moved aside and could not
    put back (it died, its catalog failed) put back, what lies at its step moved out, rows following."""
    for moved in superseded_live(cat, run_id, run_dir):
        step = _step_of(moved)
        if step is not None:
            _back(cat, run_id, step, store.step_dir(run_dir, step), moved)


def superseded_live(cat: Catalog, run_id: int, run_dir: Path) -> list[Path]:
    """The directories in the run's ``.quarantine/`` that a save of their step moved aside and that hold a
    checkpoint the run still holds (whatever the rows name): never to be reclaimed."""
    aside = run_dir / store.QUARANTINE
    try:
        candidates = sorted(aside.glob("step-*-superseded-*"))
    except OSError:
        return []
    out = []
    for moved in candidates:
        step = _step_of(moved)
        if step is None or not _holding(cat, run_id, step, moved):
            continue
        if not _holding(cat, run_id, step, store.step_dir(run_dir, step)):  # else a spare: the step holds it
            out.append(moved)
    return out


def _step_of(moved: Path) -> int | None:
    head = moved.name.split("-superseded-", 1)[0]
    step = head.removeprefix("step-")
    return int(step) if step.isdigit() else None


def _back(cat: Catalog, run_id: int, step: int, final: Path, moved: Path) -> None:
    """``moved`` (a live checkpoint's directory) back at ``final``; catalog first, so any step it stops at
    leaves what ``put_back_all`` finishes."""
    if final.exists():
        if _holding(cat, run_id, step, final):
            return  # a live checkpoint's copy is there already
        move_out(cat, final, "a save that failed")
    moved_copies.moved(cat, str(moved), str(final), "put back: the save that displaced it failed")
    os.rename(moved, final)
    with contextlib.suppress(OSError):
        store.fsync_dir(final.parent)
    log.info("step %d: the run's checkpoint moved aside by a save that failed is back at %s", step, final)


def move_out(cat: Catalog, final: Path, why: str) -> None:
    """What lies at a step that no live checkpoint holds (a save's own copy, uncommitted) moved aside into
    ``.quarantine/``, any rows naming it following it there."""
    moved_copies.moved(cat, str(final), str(store.quarantine(final, "uncommitted")), why)


def held_by_live(cat: Catalog, run_id: int, step: int, directory: Path) -> bool:
    """Whether ``directory`` holds the manifest of a checkpoint the run holds at ``step`` (committed, verified
    or corrupt): a save in flight at the step that died before its rename left that one in place."""
    return bool(_holding(cat, run_id, step, directory))


def _holding(cat: Catalog, run_id: int, step: int, directory: Path) -> list:
    """The run's live checkpoints at ``step`` whose manifest ``directory`` holds."""
    try:
        with files.open_regular(directory, mf.MANIFEST_NAME) as f:
            raw = mf.read_bounded(f)
    except (OSError, MalformedFile):
        return []
    live = lineage.checkpoints_at(cat, run_id, step, HELD)
    return [ck for ck in live if ck.manifest_digest and manifest_matches(raw, ck.manifest_digest)]
