"""Checkpoints spread over hosts' own disks: which disk each rank writes to, and the commit on every disk.

Each rank writes its shards to the checkpoint root it sees; on hosts with node-local disks (the same
path, another disk on every host) the ranks of one host share a disk and no host holds another's
files. At start every rank tells the others its disk (``local_tier``'s mark at its root); when they
differ the checkpoint is spread: rank 0's manifest names the disk of each rank's files
(``placement``), and every disk's copy holds the manifest and the files every rank needs (DCP's
``.metadata``, the shared state). Commit order: every disk's copy is renamed into place, then rank 0
commits its own and the catalog row naming every copy. Nothing is committed unless every disk's copy
is; a disk's copy renamed before rank 0 failed is removed again.

Restore (:mod:`rewind.infra.checkpoint.assemble`) completes each disk's copy from the others' before
loading."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rewind.infra.format import local_tier, payload, store
from rewind.infra.format import manifest as mf
from rewind.infra.format.local_tier import LocalTier

log = logging.getLogger(__name__)

SHARED_STATE = "state.json"  # the state tree's non-tensor values, written by rank 0
COMMON = (payload.DCP_METADATA, SHARED_STATE)  # on every disk's copy: every rank reads them


@dataclass(frozen=True, slots=True)
class Disks:
    """The disk of every rank's checkpoint root, by rank."""

    of_rank: tuple[LocalTier, ...]

    @property
    def spread(self) -> bool:
        return len({d.id for d in self.of_rank}) > 1

    def leader(self, rank: int) -> int:
        """The lowest rank writing to ``rank``'s disk: it alone writes the files a disk's copy shares."""
        disk = self.of_rank[rank].id
        return next(r for r, d in enumerate(self.of_rank) if d.id == disk)

    def leads(self, rank: int) -> bool:
        return self.leader(rank) == rank

    def placement(self, files_by_rank: Sequence[Sequence[mf.FileEntry]]) -> dict[str, str]:
        """path -> disk id of every file a rank wrote (those not ``COMMON``)."""
        return {e.path: self.of_rank[r].id for r, es in enumerate(files_by_rank) for e in es}

    def hosts(self) -> dict[str, str]:
        return {d.id: d.host for d in self.of_rank}


def discover(root: Path, group: dist.ProcessGroup | None = None) -> Disks:
    """Collective: every rank's disk (its root marked first if it has no mark)."""
    mine = local_tier.ensure(root)
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (mine.id, mine.host), group=group)
    return Disks(tuple(LocalTier(i, h) for i, h in every))


@dataclass(frozen=True, slots=True)
class Prepared:
    """What rank 0 hands every other disk's leader once each rank's files are down: the manifest's bytes
    and the shared files' bytes (their entries are the manifest's)."""

    raw: bytes
    common: dict[str, bytes]


def prepare(tmp: Path, manifest: mf.Manifest) -> Prepared:
    """Rank 0: the manifest signed, and the shared files it wrote, to be copied onto every other disk."""
    common = {e.path: (tmp / e.path).read_bytes() for e in manifest.files if e.path in COMMON}
    return Prepared(manifest.to_bytes(), common)


def commit_share(tmp: Path, prepared: Prepared, aside: list[Moved]) -> Path:
    """Another disk's leader: the shared files written beside this disk's ranks' files, each held to the
    manifest's entry, then the manifest and the rename; the committed directory. ``aside`` is told (even if
    this then fails) where a copy this disk held at the same step (a timeline the run left, superseded when
    this save commits) was moved, or, once committed, that none was there."""
    manifest = mf.parse(prepared.raw)
    want = {e.path: e for e in manifest.files}
    for name, data in prepared.common.items():
        got = store.write_file(tmp / mf.safe_relative(name), store.bytes_writer(data))
        if (got.size, got.xxh3) != (want[name].size, want[name].xxh3):
            raise OSError(f"{name} differs from the manifest's entry after it was written to {tmp}")
    store.fsync_dir(tmp)

    def displace(final: Path) -> None:
        aside.append(Moved(str(final), str(store.quarantine(final, "superseded"))))

    final = store.commit(tmp, manifest, prepared.raw, displace=displace).path
    if not aside:
        aside.append(Moved(str(final), None))
    return final


@dataclass(frozen=True, slots=True)
class Moved:
    """What a disk held where a save committed: a copy moved aside to ``new`` (``store.quarantine``: the
    catalog's rows of it must follow it), or nothing (``new`` None: rows still naming ``old`` there describe
    nothing, and must be let go before a row names the new copy)."""

    old: str
    new: str | None


def undo(path: Path | None, raw: bytes, moved: Moved | None = None) -> None:
    """Remove a disk's copy the catalog will never name (rank 0 failed to commit after it was renamed), if the
    step's directory still holds it (manifest bytes ``raw``: never a copy another writer renamed in since),
    and put back the copy it displaced (``moved``, once rank 0 moved its rows back): the step's committed
    checkpoint stays whole on every disk. A copy that cannot be put back stays aside (its rows naming the
    step's directory: the next restore of it then finds that disk's share missing there)."""
    if path is not None:
        with contextlib.suppress(OSError):
            if (path / mf.MANIFEST_NAME).read_bytes() == raw:
                shutil.rmtree(path, ignore_errors=True)
    if moved is None or moved.new is None:
        return
    try:
        os.rename(moved.new, moved.old)  # refused where something is at the step: the copy stays aside
        store.fsync_dir(Path(moved.old).parent)
    except OSError as exc:
        log.warning(
            "a copy moved aside at %s could not be put back (%s): it stays at %s", moved.old, exc, moved.new
        )
