"""What deleting frees and what copies cost: the figures ``rewind gc`` shows before and after.

A read: nothing is deleted here (``retention`` deletes). On a filesystem tier
checkpoints share unchanged chunks by hard link, so bytes count once per inode.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from rewind.infra import config
from rewind.infra.catalog import copies, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.errors import RewindError
from rewind.infra.format import manifest as mf
from rewind.infra.format import store
from rewind.infra.retention import CopyRef, GcPlan, Removal, doomed
from rewind.infra.tiers import open_tier, transfer
from rewind.infra.tiers.filesystem import root_path

log = logging.getLogger("rewind.gc")


@dataclass
class Reclaim:
    """What a plan frees on one tier: bytes whose last link (or object) goes, and files removed."""

    bytes: int = 0
    files: int = 0


@dataclass
class _Inode:
    tier: str
    size: int
    links: int  # st_nlink: every name the file has, anywhere on its filesystem
    going: int = 0  # names among the paths the plan deletes


def reclaimable(cat: Catalog, gc: GcPlan) -> dict[str, Reclaim]:
    """Per tier, the bytes deleting what the plan lists frees (a read: nothing is deleted).

    On a filesystem tier checkpoints share unchanged chunks by hard link, so a file's bytes
    are freed only when every link to its inode is among the paths that go; each inode
    counts once. S3 objects are not shared between copies: their sizes add up.
    """
    out: dict[str, Reclaim] = {}
    inodes: dict[tuple[int, int], _Inode] = {}
    seen: set[Path] = set()
    for r in (*gc.remove, *gc.reclaim):
        for ref in r.copies:
            if not doomed(cat, ref):
                continue
            tally = out.setdefault(ref.tier, Reclaim())
            if ref.uri.startswith("s3://"):
                _count_objects(ref, gc.run, r, tally)
                continue
            where = _directory(ref, gc.run, r.step)
            if where is not None and where.resolve() not in seen:
                seen.add(where.resolve())
                _count_files(where, ref.tier, tally, inodes)
    for p in gc.quarantine:  # a dead copy's row may name one of these: counted once
        if p.resolve() not in seen:
            seen.add(p.resolve())
            _count_files(p, copies.LOCAL, out.setdefault(copies.LOCAL, Reclaim()), inodes)
    for i in inodes.values():
        if i.going >= i.links:
            out[i.tier].bytes += i.size
    return out


def _directory(ref: CopyRef, run: str, step: int) -> Path | None:
    """Where a filesystem copy lies (None: a local directory Rewind did not write, and never deletes)."""
    if ref.tier == copies.MEMORY:
        return Path(ref.uri)
    if ref.tier == copies.LOCAL:
        path = Path(ref.uri)
        return path if store.owned(path, config.checkpoint_root()) else None
    return root_path(ref.uri) / mf.contained(ref.key or transfer.copy_key(run, step))


def _count_files(where: Path, tier: str, tally: Reclaim, inodes: dict[tuple[int, int], _Inode]) -> None:
    for top, _dirs, files in os.walk(where):
        for name in files:
            try:
                st = os.lstat(os.path.join(top, name))
            except FileNotFoundError:
                continue  # deleted meanwhile (another gc): not ours to count
            tally.files += 1
            if stat.S_ISREG(st.st_mode):
                inodes.setdefault((st.st_dev, st.st_ino), _Inode(tier, st.st_size, st.st_nlink)).going += 1


def _count_objects(ref: CopyRef, run: str, r: Removal, tally: Reclaim) -> None:
    base = ref.key or transfer.copy_key(run, r.step)
    try:
        for obj in open_tier(ref.uri).list(f"{base}/"):
            tally.bytes += obj.size
            tally.files += 1
    except RewindError as exc:  # the figure falls back to what the catalog recorded
        log.warning("could not list %s/%s: %s; counting the catalog's %d bytes", ref.uri, base, exc, r.bytes)
        tally.bytes += r.bytes


def usage(cat: Catalog, run: str | None, price_per_gb_month: float) -> list[dict[str, object]]:
    """Bytes held per tier and what they cost a month."""
    totals: dict[str, int] = {}
    for row in lineage.replica_bytes(cat, run):
        totals[row[0]] = totals.get(row[0], 0) + int(row[1] or 0)
    return [
        {
            "tier": t,
            "bytes": b,
            "gb": round(b / 1e9, 3),
            "usd_per_month": round(b / 1e9 * price_per_gb_month, 2),
        }
        for t, b in sorted(totals.items())
    ]
