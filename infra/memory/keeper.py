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
from rewind.infra.format import local_tier, segments, store
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
        store.sweep_temp(cfg.root / run)  # what a copy killed midway left (its process gone)
        rows = held.held_on(cat, copies.MEMORY, here.id)
        # the peer ring's copies: counted, let go only by ``ring_room``
        have = [h for h in rows if not h.ring]
        if any(h.checkpoint_id == checkpoint_id for h in have):
            return None
        if not _displace(cat, have, store.step_dir(cfg.root / run, ck.step), checkpoint_id):
            return None
        lease = leases.take(cat, checkpoint_id, f"{leases.lease_holder()}:memory-tier")
        room = None
        try:
            room = _room(cat, cfg, have, run, ck, reserved=sum(h.nbytes for h in rows if h.ring))
            if room is None:
                return None
            evicted = _let_go(cat, cfg, room, run)
            done = fetch.pull(
                FileTier(str(src.parent)), src.name, str(ck.manifest_digest), cfg.root / run,
                keyring=keyring if keyring is not None else kr.from_env(), displace=remove,
                segment=segments.SEGMENT,
            )  # fmt: skip
            copies.add(cat, checkpoint_id, copies.MEMORY, str(done.path), key=None,
                       nbytes=done.manifest.total_bytes, status=R.VERIFIED,
                       segments=segments.dumps(done.segments))  # fmt: skip
        finally:
            if room is not None:
                room.rings.release()  # let go of the ended runs' locks, whatever happened
            leases.release(cat, lease)
    seconds = time.perf_counter() - started
    return Kept(checkpoint_id, ck.step, done.path, done.manifest.total_bytes, seconds, evicted)


def _displace(cat: Catalog, have: list[held.Held], final: Path, checkpoint_id: int) -> bool:
    """The copy of another checkpoint at ``final`` (the step saved again: a replayed timeline) recorded let
    go before the copy of ``checkpoint_id`` takes its place, so no row names bytes not its own; False (nothing
    done) while a restore holds it."""
    there = [h for h in have if Path(h.uri) == final and h.checkpoint_id != checkpoint_id]
    if any(leases.leased(cat, h.checkpoint_id) for h in there):
        log.info("%s is being restored from: the checkpoint saved again at its step is not held yet", final)
        return False
    for h in there:  # the row first, then the bytes (never left unnamed should the copy not be made now)
        copies.record(cat, h.replica_id, R.DELETED, "let go from the memory tier: its step saved again")
        remove(h.uri)
    return True


@dataclass
class Room:
    """What goes for a copy to fit: the keeper's own copies and ended runs' ring copies (locks held)."""

    going: list[held.Held]
    rings: ring_room.Eviction


def _room(
    cat: Catalog, cfg: MemoryConfig, have: list[held.Held], run: str, ck: Checkpoint, *, reserved: int
) -> Room | None:
    """What must go for ``ck`` to fit, decided before anything goes: the run's older copies past
    ``keep - 1``, then the oldest past the budget, then ended runs' ring copies; None (nothing let go) when
    it cannot fit beside what may not go (copies a restore holds, live runs' ring copies, bytes on the
    tier that no row of this catalog names)."""
    leased = {h.checkpoint_id for h in have if leases.leased(cat, h.checkpoint_id)}
    free = [h for h in have if h.checkpoint_id not in leased]
    need = ck.total_bytes or 0
    mine = [h for h in free if h.run == run and h.step < ck.step]
    going = mine[: max(0, len(mine) - (cfg.keep - 1))]
    recorded = reserved + sum(h.nbytes for h in have)
    # bytes on the tier no row here names (a pass under way, another catalog's copies) count all the same
    used = max(recorded, ring_room.tier_bytes(cfg.root)) - sum(h.nbytes for h in going)
    for h in sorted((h for h in free if h not in going), key=lambda h: (h.step, h.replica_id)):
        if used + need <= cfg.budget_bytes:
            break
        going.append(h)
        used -= h.nbytes
    rings = ring_room.choose(cfg.root, run, used + need - cfg.budget_bytes)
    if used - rings.nbytes + need > cfg.budget_bytes:
        rings.release()
        log.warning("%s step %d not held in memory: %d bytes of the budget (%d) are held by a restore or "
                    "live runs' ring copies", run, ck.step, used, cfg.budget_bytes)  # fmt: skip
        return None
    return Room(going, rings)


def _let_go(cat: Catalog, cfg: MemoryConfig, room: Room, run: str) -> tuple[int, ...]:
    """The room made: the catalog first, then the bytes; the keeper's checkpoint ids let go."""
    for h in room.going:
        copies.record(cat, h.replica_id, R.DELETED, "let go from the memory tier")
        remove(h.uri)
    gone = room.rings.commit()
    ring_room.record(cat, mark(cfg).id, gone, R.DELETED, f"let go from the memory tier: room for {run}")
    return tuple(h.checkpoint_id for h in room.going)


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
