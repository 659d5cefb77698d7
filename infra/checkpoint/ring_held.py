"""What this node's memory holds of a checkpoint in the peer ring's copies (``ring``), proven file by file
before a restore takes any of it, and what it refused, so that the catalog stops counting on it."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.checkpoint import ring
from rewind.infra.errors import ConfigError
from rewind.infra.format import manifest as mf
from rewind.infra.format.digest import hash_file
from rewind.infra.memory import keeper, ring_room

log = logging.getLogger("rewind.ring")


@dataclass(frozen=True, slots=True)
class Found:
    """The checkpoint's files a node's memory holds (path -> the ring copy holding it, each file proven
    against its entry), the ring copies refused (a file did not prove: removed) and the memory tier's id."""

    files: dict[str, Path] = field(default_factory=dict)
    refused: tuple[str, ...] = ()
    tier_id: str = ""


def held(raw: bytes, manifest: mf.Manifest) -> Found:
    """The checkpoint's files (manifest ``raw``) this node's memory tier holds in a ring copy, each hashed
    against its entry. A ring copy with a file that does not prove is refused and removed. Never raises: a
    memory tier that cannot be read holds nothing."""
    cfg = ring._config()
    if cfg is None:
        return Found()
    found: dict[str, Path] = {}
    refused: list[str] = []
    try:
        if not ring.on():
            return Found()
        mark = keeper.mark(cfg)  # this user's own directory, not a link: never read through another's
        for m in (cfg.root / ring.RING_DIR).glob(f"*/step-*-*/{mf.MANIFEST_NAME}"):
            if m.read_bytes() == raw:
                proven = _proven(m.parent, manifest)
                found.update(proven or {})
                refused += [str(m.parent)] if proven is None else []
    except (OSError, ConfigError) as exc:
        log.warning("the memory tier's ring copies not read: %s", exc)
        return Found()
    return Found(found, tuple(refused), mark.id)


def record_refused(cat: Catalog, tier_id: str, refused: tuple[str, ...]) -> None:
    """The rows of ring copies a restore refused in the memory tier ``tier_id`` recorded corrupt: no
    recovery counts on them again."""
    ring_room.record(cat, tier_id, refused, R.CORRUPT, "refused at a restore: a file differs from its entry")


def _proven(copy: Path, manifest: mf.Manifest) -> dict[str, Path] | None:
    """The copy's files, each proven; None when one does not prove (the copy then removed)."""
    got: dict[str, Path] = {}
    for e in manifest.files:
        path = copy / mf.safe_relative(e.path)
        if not path.is_file():
            continue
        try:
            digest = hash_file(path, with_crc=False)
        except OSError:
            digest = None
        if digest is None or (digest.size, digest.xxh3) != (e.size, e.xxh3):
            log.warning(
                "ring copy %s: %s differs from the manifest's entry: refused and removed", copy, e.path
            )
            shutil.rmtree(copy, ignore_errors=True)
            return None
        got[e.path] = copy
    return got
