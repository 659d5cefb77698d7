"""What this node's memory holds of a checkpoint in the peer ring's copies (``ring``): the files present at
their entries' sizes, each proven where a restore reads it (as it is taken or loaded, never on the listing's
word), and what a file that did not prove costs: a host's own file alone, or the whole copy for a file of
the peer's share (removed; the catalog stops counting on it)."""

from __future__ import annotations

import contextlib
import logging
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import ring
from rewind.infra.checkpoint.spread import Disks
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.memory import keeper, ring_room

log = logging.getLogger("rewind.ring")


@dataclass(frozen=True, slots=True)
class Found:
    """The checkpoint's files a node's memory holds (path -> the ring copy holding it: a regular file of its
    entry's size, not yet proven), the memory tier's id, and files present but of another size or kind
    (path -> the copy: ``failed``)."""

    files: dict[str, Path] = field(default_factory=dict)
    tier_id: str = ""
    wrong: dict[str, Path] = field(default_factory=dict)


def held(raw: bytes, manifest: mf.Manifest) -> Found:
    """The checkpoint's files (manifest ``raw``) this node's memory tier holds in a ring copy: regular files of
    their entries' sizes, not hashed here (each is proven as it is taken or loaded: hashing them here too would
    read every byte twice). Never raises: a memory tier that cannot be read holds nothing."""
    cfg = ring._config()
    if cfg is None:
        return Found()
    found: dict[str, Path] = {}
    wrong: dict[str, Path] = {}
    try:
        if not ring.on():
            return Found()
        mark = keeper.mark(cfg)  # this user's own directory, not a link: never read through another's
        for m in (cfg.root / ring.RING_DIR).glob(f"*/step-*-*/{mf.MANIFEST_NAME}"):
            if m.read_bytes() == raw:
                present, odd = _present(m.parent, manifest)
                found.update(present)
                wrong.update(odd)
    except (OSError, ConfigError) as exc:
        log.warning("the memory tier's ring copies not read: %s", exc)
        return Found()
    return Found(found, mark.id, wrong)


def failed(copy: Path, path: str, manifest: mf.Manifest, disk: str) -> str | None:
    """A file of ring copy ``copy`` that did not prove, on the host whose disk is ``disk``: one of its own
    (placed on ``disk``, or on every disk: the disk holds it) is removed alone, the peer's share never
    depending on it; one of the peer's share refuses the copy (``refuse``: its directory returned)."""
    if manifest.placement.get(path, disk) != disk:
        return refuse(copy, path)
    log.warning(
        "ring copy %s: this host's own %s differs from its entry: removed (its disk holds it)", copy, path
    )
    with contextlib.suppress(OSError):
        (copy / mf.safe_relative(path)).unlink()
    return None


def refuse(copy: Path, path: str) -> str:
    """A ring copy whose file ``path`` did not prove: removed, never offered again; its directory (for
    ``record_refused``)."""
    log.warning("ring copy %s: %s differs from the manifest's entry: refused and removed", copy, path)
    shutil.rmtree(copy, ignore_errors=True)
    return str(copy)


def drop_missed(
    manifest: mf.Manifest,
    disks: Disks,
    rank: int,
    missed: list[tuple[tuple[str, str, str], ...]],
    record: Callable[[str, tuple[str, ...]], None] | None,
) -> None:
    """After a load: the memory files each rank found not proving (``missed[r]``: (path, ring copy, memory
    tier id), read from the disk instead). Each host's leader (``rank``) drops its host's ones (``failed``: a
    file of its own alone, a file of the peer's share the whole copy); rank 0 (``record``) records those
    copies refused. Never raises."""
    seen: set[tuple[str, str, str]] = set()
    for r, found in enumerate(missed):
        disk = disks.of_rank[r].id
        for path, copy, tier_id in found:
            if (path, copy, tier_id) in seen:
                continue
            seen.add((path, copy, tier_id))
            if disks.leads(rank) and disks.leader(r) == disks.leader(rank):
                failed(Path(copy), path, manifest, disk)
            if record is not None and manifest.placement.get(path, disk) != disk:
                try:
                    record(tier_id, (copy,))
                except Exception as exc:  # the restore goes on: the copy is gone, the row says so later
                    log.warning("ring copy %s refused at a load not recorded: %s", copy, exc)


def record_refused(cat: Catalog, tier_id: str, refused: tuple[str, ...]) -> None:
    """The rows of ring copies a restore refused in the memory tier ``tier_id`` recorded corrupt: no
    recovery counts on them again."""
    ring_room.record(cat, tier_id, refused, R.CORRUPT, "refused at a restore: a file differs from its entry")


def _present(copy: Path, manifest: mf.Manifest) -> tuple[dict[str, Path], dict[str, Path]]:
    """The manifest's files the copy holds as regular files of their entries' sizes, and those present of
    another size or kind (each path -> the copy); a file absent is neither (its own files may be let go)."""
    got: dict[str, Path] = {}
    odd: dict[str, Path] = {}
    for e in manifest.files:
        try:
            st = (copy / mf.safe_relative(e.path)).lstat()
        except OSError:
            continue
        ok = stat.S_ISREG(st.st_mode) and st.st_size == e.size
        (got if ok else odd)[e.path] = copy
    return got, odd
