"""A committed checkpoint copied into the node's memory tier, and older ones let go within its budget.

The copy is made from the checkpoint's local copy on this node with the commit protocol of every other
download (``fetch.pull``): the manifest is held to the catalog's digest, every file hashed against its
entry while it is copied, the manifest written last; only then is the copy registered (tier ``memory``,
verified). A restore reads it in place like a local copy, each byte hashed again as it is loaded. Room is
made before the copy: the oldest copies past the budget, and each run's past the count to keep, are let go
(the catalog first, then the bytes); one a restore holds a lease on is never let go.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rewind.infra.catalog import copies, disks, held, leases, lineage
from rewind.infra.catalog.db import Catalog
from rewind.infra.catalog.models import Checkpoint
from rewind.infra.catalog.models import ReplicaStatus as R
from rewind.infra.errors import ConfigError
from rewind.infra.format import keyring as kr
from rewind.infra.format import local_tier
from rewind.infra.format import manifest as mf
from rewind.infra.format.verify import partial
from rewind.infra.memory import ring_room
from rewind.infra.memory.place import MemoryConfig
from rewind.infra.tiers import fetch
from rewind.infra.tiers.filesystem import FileTier

log = logging.getLogger("rewind.memory")
SOUND = (R.VERIFIED.value, R.PENDING.value)
LOCK = ".lock"


@dataclass(frozen=True, slots=True)
class Kept:
    checkpoint_id: int
    step: int
    directory: Path
    nbytes: int
    seconds: float
    evicted: tuple[int, ...]  # checkpoint ids whose memory copies were let go


def mark(cfg: MemoryConfig) -> local_tier.LocalTier:
    """The memory tier's mark (made on first use), its directory closed to other users. A path another
    user made first (/dev/shm is everyone's), or a symbolic link, is refused: never written through."""
    cfg.root.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(cfg.root)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise ConfigError(f"the memory tier {cfg.root} is not a directory of this user's: not used")
    cfg.root.chmod(0o700)
    return local_tier.ensure(cfg.root)


def source(cat: Catalog, checkpoint_id: int) -> Path | None:
    """The checkpoint's sound local copy on a disk this node sees, holding every file (not one disk's share)."""
    for r in copies.copies_of(cat, [checkpoint_id]).get(checkpoint_id, []):
        if r.tier != copies.LOCAL or r.status not in SOUND or disks.elsewhere(r.tier, r.tier_id, r.uri):
            continue
        directory = Path(r.uri)
        try:
            if not partial(directory, mf.read(directory)):
                return directory
        except (OSError, mf.ManifestError):
            continue
    return None


def keep(
    cat: Catalog, checkpoint_id: int, cfg: MemoryConfig, *, keyring: kr.Keyring | None = None
) -> Kept | None:
    """Copy the checkpoint into memory; None when it is there already, has no whole local copy here, or is
    larger than the budget."""
    started = time.perf_counter()
    ck = lineage.get_checkpoint(cat, checkpoint_id)
    run = lineage.get_run_by_id(cat, ck.run_id).name
    if ck.manifest_digest is None:
        return None
    if (ck.total_bytes or 0) > cfg.budget_bytes:
        log.warning("%s step %d (%d bytes) is larger than the memory budget (%d bytes): not held", run, ck.step,
                    ck.total_bytes, cfg.budget_bytes)  # fmt: skip
        return None
    src = source(cat, checkpoint_id)
    if src is None:
        return None
    here = mark(cfg)
    with _alone(
        cfg.root
    ):  # one copy at a time per memory tier (an agent of an earlier launch may still copy)
        _room_from_ended_rings(cat, cfg, run, ck.total_bytes or 0)
        rows = held.held_on(cat, copies.MEMORY, here.id)
        have = [h for h in rows if not h.ring]  # the peer ring's copies: counted, let go only as above
        reserved = sum(h.nbytes for h in rows if h.ring)
        if any(h.checkpoint_id == checkpoint_id for h in have):
            return None
        lease = leases.take(cat, checkpoint_id, "memory-tier")
        try:
            evicted = make_room(cat, cfg, have, run, ck, reserved=reserved)
            left = reserved + sum(h.nbytes for h in have if h.checkpoint_id not in evicted)
            if left + (ck.total_bytes or 0) > cfg.budget_bytes:  # what holds the rest is not ours to let go
                log.warning("%s step %d not held in memory: %d bytes of the budget (%d) are held by a restore "
                            "or another run's ring copies", run, ck.step, left, cfg.budget_bytes)  # fmt: skip
                return None
            done = fetch.pull(
                FileTier(str(src.parent)), src.name, str(ck.manifest_digest), cfg.root / run,
                keyring=keyring if keyring is not None else kr.from_env(), displace=remove,
            )  # fmt: skip
            copies.add(cat, checkpoint_id, copies.MEMORY, str(done.path), key=None,
                       nbytes=done.manifest.total_bytes, status=R.VERIFIED)  # fmt: skip
        finally:
            leases.release(cat, lease)
    seconds = time.perf_counter() - started
    return Kept(checkpoint_id, ck.step, done.path, done.manifest.total_bytes, seconds, evicted)


def make_room(
    cat: Catalog, cfg: MemoryConfig, have: list[held.Held], run: str, ck: Checkpoint, *, reserved: int = 0
) -> tuple[int, ...]:
    """Let go of what must go for ``ck`` to fit: the run's older copies past ``keep - 1``, then the oldest
    past the budget. A leased copy (a restore reading it) stays. ``reserved``: bytes held in the tier that
    are not ``have``'s to let go (the peer ring's)."""
    going: list[held.Held] = []
    mine = [h for h in have if h.run == run and h.step < ck.step]
    going += mine[: max(0, len(mine) - (cfg.keep - 1))]
    used = reserved + sum(h.nbytes for h in have if h not in going)
    for h in sorted((h for h in have if h not in going), key=lambda h: (h.step, h.replica_id)):
        if used + (ck.total_bytes or 0) <= cfg.budget_bytes:
            break
        going.append(h)
        used -= h.nbytes
    let_go = []
    for h in going:
        if leases.leased(cat, h.checkpoint_id):
            continue
        copies.record(cat, h.replica_id, R.DELETED, "let go from the memory tier")  # the catalog first
        remove(h.uri)
        let_go.append(h.checkpoint_id)
    return tuple(let_go)


def _room_from_ended_rings(cat: Catalog, cfg: MemoryConfig, run: str, need: int) -> None:
    """Ring copies of runs ended on this host let go (oldest made first) while the tier is short of room
    for ``need`` more bytes; their rows let go too."""
    try:
        _, gone = ring_room.make_room(cfg.root, run, need=need, budget=cfg.budget_bytes)
    except OSError as exc:  # what is held is weighed from the catalog below all the same
        log.warning("memory tier %s: ended runs' ring copies not weighed: %s", cfg.root, exc)
        return
    if gone:
        ring_room.record_let_go(cat, mark(cfg).host, gone, f"let go from the memory tier: room for {run}")


@contextlib.contextmanager
def _alone(root: Path) -> Iterator[None]:
    with open(root / LOCK, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def remove(directory: str | Path) -> None:
    """A memory copy's bytes gone (the memory tier is Rewind's own: nothing in it is a user's)."""
    shutil.rmtree(directory, ignore_errors=True)
